"""Hard crashes in flight mode: `pdbg record` runs the script in a child process whose flight ring
lives in shared memory; when the child dies hard, the parent writes out what the ring held for the
steps committed before, and the run opens as crashed with those payloads exact.

The scripts run tests/recorder/abort_script.py; the test recomputes what it computed from the same
seed (the model is tiny and single-threaded, so the bits are the same in this process).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr

import recorder
import replayer
from recorder import payload as payload_mod
from recorder import shmring
from recorder.store import layout
from recorder.store.reader import RunReader
from recorder.store.writer import StoreWriter
from tests.cli import env
from tests.recorder import abort_script as script
from tests.recorder.test_flight import assert_ring_written_on_sigterm, payload_iterations

if not hasattr(signal, "SIGKILL") or not os.path.exists("/proc/self/maps"):
    pytest.skip("needs POSIX signals and /proc", allow_module_level=True)

SCRIPT = Path(script.__file__)

RECORD = [sys.executable, "-m", "tui.cli", "record", "-o", "run.zarr", "--mode", "flight", "--keep", "2"]


def record(tmp_path: Path, *args: str, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*RECORD, "--modules", "*", "--", str(SCRIPT), *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, check=False, env={**env(), **(extra_env or {})})


def recomputed(last: int) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """What each module's forward call saw, per (iteration, module path), as the script ran it."""
    torch.set_num_threads(1)  # as the script; the conftest fixture restores the count
    model = script.build()
    opt = torch.optim.SGD(model.parameters(), lr=script.LR)
    seen: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    now = [0]

    def hook(path: str) -> Any:
        def keep(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            seen[(now[0], path)] = {"args.0": inputs[0].detach().clone(), "output": output.detach().clone(),
                                    **{n: p.detach().clone() for n, p in module.named_parameters()}}
        return keep

    for path, module in model.named_children():
        module.register_forward_hook(hook(path))
    for i in range(last + 1):
        now[0] = i
        model(script.input_for(i)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return seen


def forward_payloads(path: Path) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """The recorded tensors that have bytes, of every forward step, by (iteration, module path)."""
    rank = RunReader(str(path)).rank(0)
    out = {}
    for step in range(len(rank)):
        if int(rank.column("steps/phase")[step]) == 0:
            where = (int(rank.column("steps/iteration")[step]), rank.doc(int(rank.column("steps/module_path")[step])))
            out[where] = {r.name: rank.tensor(r) for r in rank.tensor_records(step) if r.has_payload}
    return out


class TestHardCrash:
    @pytest.mark.parametrize("how, sig", [("abort", signal.SIGABRT), ("kill", signal.SIGKILL)])
    def test_the_ring_of_a_script_that_died_hard_is_written_out(self, tmp_path: Path, how: str, sig: int) -> None:
        """os.abort() (or the OOM killer's SIGKILL) at iteration 30 of 50, keep=2: pdbg exits 128+N,
        the run is crashed and says how it died, and the payloads of iterations 29 and 30 (committed
        before the death) are there, bitwise as the script computed them; no other iteration has any."""
        rec = record(tmp_path, "50", "--die-at", "30", "--how", how, "--maps")
        assert rec.returncode == 128 + sig, rec.stderr
        assert "ring: /memfd:pdbg-flight-ring (deleted)" in rec.stdout  # the ring was in shared memory
        path = tmp_path / "run.zarr"
        run = RunReader(str(path))
        assert run.status == "crashed"
        final = run.attrs["final"]
        assert final["status"] == "crashed" and final["died"] == f"signal {signal.Signals(sig).name}"
        assert replayer.open(path).ended_by == f"the process died (signal {signal.Signals(sig).name})"
        recorded, kept = payload_iterations(path)
        assert recorded == set(range(31)) and kept == {29, 30}
        ring = final["ring_recovered"]
        assert ring["iterations"] == [29, 30] and ring["records"] >= 2 * 6 and ring["payloads"] > 0
        assert ring["damaged"] == ring["uncommitted_records"] == ring["unshared_payloads"] == 0
        expected, got = recomputed(30), forward_payloads(path)
        assert {k for k, v in got.items() if v} == {(i, p) for i in (29, 30) for p in ("0", "1", "2")}
        for where, tensors in got.items():
            if tensors:
                assert tensors.keys() == expected[where].keys(), where
                for name, t in tensors.items():
                    want = expected[where][name]
                    assert t.dtype == want.dtype and torch.equal(t.view(torch.int32), want.view(torch.int32)), where
        assert f"(crashed, {len(run.rank(0))} steps); the script's process died (signal " in rec.stderr
        assert "Traceback" not in rec.stderr

    def test_a_ring_of_uncommitted_steps_only_says_what_to_raise(self, tmp_path: Path) -> None:
        """Iterations far shorter than a second: at the death the ring held only steps not yet
        committed (the last commit was at iteration 5), so nothing of it can be written; pdbg says
        so, and to raise --keep, instead of only that the ring held nothing."""
        rec = record(tmp_path, "50", "--die-at", "30", "--no-flush", "--flush-at", "5")
        assert rec.returncode == 128 + signal.SIGABRT, rec.stderr
        ring = RunReader(str(tmp_path / "run.zarr")).attrs["final"]["ring_recovered"]
        assert ring["records"] == 0 and ring["uncommitted_records"] > 0, ring
        assert rec.stderr.rstrip().endswith(
            "; the flight ring held payloads only of steps not yet committed (steps commit every second): record "
            "with a larger --keep, so that the ring spans more than a second, to keep the last committed "
            "iterations"), rec.stderr

    def test_the_iterations_written_before_and_after_the_death_are_all_named(self, tmp_path: Path) -> None:
        """A NaN at iteration 3 writes the ring (iterations 2 and 3); the process dies at iteration 9 and
        pdbg writes out 8 and 9. The run's final metadata is written by pdbg, not by the process that
        wrote the ring at 3: `pdbg info` said "known when the recording closes", and the statistics-only
        answers named no iteration. Now both name exactly the iterations whose tensors are there."""
        rec = record(tmp_path, "20", "--nan-at", "3", "--die-at", "9")
        assert rec.returncode == 128 + signal.SIGABRT, rec.stderr
        path = tmp_path / "run.zarr"
        recorded, kept = payload_iterations(path)
        assert recorded == set(range(10)) and kept == {2, 3, 8, 9}
        rank = RunReader(str(path)).rank(0)
        assert rank.ring_iterations() == [2, 3, 8, 9]
        info = subprocess.run([sys.executable, "-m", "tui.cli", "info", "run.zarr", "--json"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120, check=False, env=env())
        assert json.loads(info.stdout)["tensors_kept"] == (
            "iterations 2, 3, 8, 9 (the flight ring, written out at: nonfinite, the process's death (by pdbg "
            "record))"), info.stdout + info.stderr
        unkept = [r for r in rank.tensor_records(0) if not r.has_payload][0]
        assert rank.why_statistics_only(unkept) == (
            "flight mode keeps the tensors of the iterations its ring wrote out (2, 3, 8, 9), and iteration 0 is "
            "not one of them")

    def test_a_script_that_ends_normally_leaves_no_shared_memory_behind(self, tmp_path: Path) -> None:
        """With the ring in a file ($PDBG_RING_DIR), the script maps it while it runs, and nothing is
        left in that directory once pdbg is done; the run is complete, the ring written at the end."""
        ring_dir = tmp_path / "shm"
        ring_dir.mkdir()
        rec = record(tmp_path, "4", "--maps", extra_env={shmring.RING_DIR_ENV: str(ring_dir)})
        assert rec.returncode == 0, rec.stderr
        (line,) = [ln for ln in rec.stdout.splitlines() if ln.startswith("ring: ")]
        assert line.startswith(f"ring: {ring_dir}/pdbg-ring-") and line.endswith(" (deleted)")
        assert list(ring_dir.iterdir()) == []
        path = tmp_path / "run.zarr"
        assert RunReader(str(path)).status == "complete"
        assert payload_iterations(path) == (set(range(4)), {2, 3})
        assert "pdbg: recording in run.zarr (complete, 24 steps)" in rec.stderr.splitlines()

    def test_sigterm_to_pdbg_is_forwarded_and_the_ring_written(self, tmp_path: Path) -> None:
        """SIGTERM to the `pdbg record` process (not the script's): the script's flight handler writes
        the ring and closes the run; pdbg exits 128+15."""
        proc = subprocess.Popen([*RECORD, "--modules", "*", "--", str(SCRIPT), "0", "--forever"], cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
        assert proc.stdout is not None
        for line in proc.stdout:  # blocks until the script has trained a few iterations
            if line.strip() == "iteration 5":
                break
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signal.SIGTERM, err
        assert_ring_written_on_sigterm(tmp_path / "run.zarr")
        assert "the script's process died (signal SIGTERM)" in err

    @pytest.mark.parametrize("to", ["group", "pdbg"])
    def test_one_sigterm_reaches_the_script_once(self, tmp_path: Path, to: str) -> None:
        """A script whose SIGTERM handler escalates (the first: checkpoint at the end of the step; a
        second: exit now, no checkpoint). SIGTERM to the job's process group, as a scheduler's cancel
        or time limit sends it, reached the child directly and again as pdbg's forward of it: the
        script exited without its checkpoint (2 runs in 5). Sent to pdbg alone, it is still forwarded."""
        (tmp_path / "escalate.py").write_text(ESCALATING)
        for attempt in range(3 if to == "group" else 1):
            out = tmp_path / f"run{attempt}.zarr"
            proc = subprocess.Popen([sys.executable, "-m", "tui.cli", "record", "-o", str(out), "--mode", "flight",
                                     "--", "escalate.py"], cwd=tmp_path, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=env(), start_new_session=True)
            assert proc.stdout is not None
            for line in proc.stdout:  # blocks until the script is training
                if line.startswith("training"):
                    break
            if to == "group":
                os.killpg(proc.pid, signal.SIGTERM)
            else:
                proc.send_signal(signal.SIGTERM)
            rest, err = proc.communicate(timeout=120)
            # (the handler's line may land inside "training\n": it runs between any two bytecodes)
            assert re.findall(r"SIGTERM \d+", rest) == ["SIGTERM 1"], rest + err
            assert "checkpoint saved" in rest and proc.returncode == 0, rest + err
            assert RunReader(str(out)).status == "complete"

    def test_sigterm_before_anything_was_recorded_is_named(self, tmp_path: Path) -> None:
        """A job preempted while loading, before it called any module: the recording said no reason
        (ended_by null), and pdbg advised naming modules with --modules, which would not have
        recorded anything either. Now both name the signal."""
        (tmp_path / "early.py").write_text("import os, signal\nimport torch\nmodel = torch.nn.Linear(4, 4)\n"
                                           "os.kill(os.getpid(), signal.SIGTERM)\nmodel(torch.randn(2, 4))\n")
        rec = subprocess.run([sys.executable, "-m", "tui.cli", "record", "-o", "run.zarr", "--mode", "flight", "--",
                              "early.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
                             env=env())
        assert rec.returncode == 128 + signal.SIGTERM, rec.stderr
        assert rec.stderr.splitlines() == ["pdbg: recording in run.zarr (crashed, 0 steps); no step was recorded: the "
                                           "script was ended by SIGTERM before it recorded anything"]
        assert replayer.open(tmp_path / "run.zarr").ended_by == "SIGTERM"

    @pytest.mark.parametrize("mode", ["full", "stats"])
    def test_sigterm_in_pdbgs_own_process_prints_the_last_line(self, tmp_path: Path, mode: str) -> None:
        """Full and stats mode record in pdbg's own process, which SIGTERM ends: pdbg printed no last line
        there (flight mode's parent does). The recording closes, says so, and the process dies of the signal."""
        (tmp_path / "late.py").write_text("import os, signal\nimport torch\n"
                                          "model = torch.nn.Sequential(torch.nn.Linear(4, 4))\n"
                                          "for i in range(3):\n    model(torch.randn(2, 4)).sum().backward()\n"
                                          "os.kill(os.getpid(), signal.SIGTERM)\nprint('not reached')\n")
        rec = subprocess.run([sys.executable, "-m", "tui.cli", "record", "-o", "run.zarr", "--mode", mode,
                              "--modules", "*", "--", "late.py"], cwd=tmp_path, capture_output=True, text=True,
                             timeout=120, check=False, env=env())
        assert rec.returncode == -signal.SIGTERM and rec.stdout == "", rec.stderr  # (a shell says 143)
        steps = len(replayer.open(tmp_path / "run.zarr").steps)
        assert steps == 6 and rec.stderr.splitlines()[-1] == (
            "pdbg: recording in run.zarr (crashed, 6 steps); the script's process died (signal SIGTERM)"), rec.stderr
        assert replayer.open(tmp_path / "run.zarr").ended_by == "SIGTERM"

    def test_bad_options_are_one_line_errors(self, tmp_path: Path) -> None:
        """A bad --keep (checked by pdbg) and a bad glob (refused by the recording, in the child):
        exit 2, one line, no traceback, no recording left."""
        for bad, message in ((["--keep", "0"], "pdbg: error: --keep must be a positive integer"),
                             (["--modules", "a..b"], "pdbg: error: invalid module glob")):
            rec = subprocess.run([*RECORD, *bad, "--", str(SCRIPT), "1"], cwd=tmp_path, capture_output=True,
                                 text=True, timeout=120, check=False, env=env())
            assert rec.returncode == 2, rec.stderr
            (line,) = rec.stderr.strip().splitlines()
            assert line.startswith(message)
            assert not (tmp_path / "run.zarr").exists()


ESCALATING = """
import signal, sys
import torch, torch.nn as nn

got = []
def on_term(signum, frame):
    got.append(signum)
    print(f"SIGTERM {len(got)}", flush=True)
    if len(got) > 1:
        print("exiting now, no checkpoint", flush=True)
        sys.exit(1)
signal.signal(signal.SIGTERM, on_term)

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
while True:
    print("training", flush=True)
    for _ in range(20):  # a step's work: a second copy of the signal, if any, comes meanwhile
        model(torch.randn(32, 64)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    if got:
        torch.save(model.state_dict(), "checkpoint.pt")
        print("checkpoint saved", flush=True)
        sys.exit(0)
"""


class TestSharedRing:
    def test_journal_holds_what_was_published_and_not_what_was_given_back(self) -> None:
        """Published buffers and waiting rows are what the parent reads; buffers given back and rows
        done are not; freed blocks coalesce back into one."""
        ring_file = shmring.create(1 << 20)
        try:
            ring = shmring.SharedRing(ring_file.fd)
            kept, gone = np.arange(1000, dtype=np.uint32), np.arange(7, dtype=np.uint32)
            keys = []
            for units in (kept, gone):
                buf = ring.take(units.nbytes)
                assert buf is not None
                buf.view(np.uint32)[:] = units
                keys.append(payload_mod.content_key(units, 2))
                ring.publish(buf, keys[-1])
                if units is gone:
                    ring.give(buf)
            assert ring.take(1 << 40) is None  # no room: the caller keeps the bytes itself
            ring.wait(5, keys[0], 3)
            ring.wait(6, keys[1], 3)
            ring.done(6)
            ring.held_from(2)
            with shmring.read_journal(ring_file) as journal:
                assert list(journal.payloads) == [keys[0]]
                assert np.array_equal(journal.payloads[keys[0]], kept)
                assert journal.rows == [(5, 3, keys[0])] and journal.oldest == 2 and journal.unshared == 1
        finally:
            ring_file.close()

    def test_buddy_blocks_coalesce(self) -> None:
        """Many blocks of mixed sizes, all given back: the whole data region is one free block again."""
        ring_file = shmring.create(1 << 20)
        try:
            ring = shmring.SharedRing(ring_file.fd)
            bufs = [ring.take(n) for n in (300, 5000, 1 << 16, 1, 70000, 256) * 8]
            assert all(b is not None for b in bufs)
            offsets = [ring._blocks[id(b)][0] for b in bufs]
            assert len(set(offsets)) == len(offsets)
            for b in bufs:
                ring.give(b)
            assert ring.take(len(ring.data)) is not None  # drained and merged first
        finally:
            ring_file.close()


def test_resume_appends_after_the_committed_lengths(tmp_path: Path) -> None:
    """StoreWriter.resume on a store whose manifest commits less than its chunks hold (a writer killed
    after writing chunks, before its manifest): appends land right after the committed rows,
    overwriting what the dead writer left past them, and the closed run reads back exactly."""
    path = tmp_path / "run.zarr"
    with recorder.record(path, mode="full", flush_interval=3600) as run:
        @recorder.paper_step("Eq. 1")
        def double(x: torch.Tensor) -> torch.Tensor:
            return x * 2

        double(torch.arange(4.0))
        assert run.flush()
        committed = (path / layout.MANIFEST_KEY).read_bytes()
        for i in range(3):  # written after the commit: garbage to the resumed writer
            double(torch.full((5,), float(i)))
    manifest = json.loads(committed)
    (path / layout.MANIFEST_KEY).write_bytes(committed)
    lengths = manifest["ranks"]["0"]
    writer = StoreWriter.resume(zarr.storage.LocalStore(path), 0)
    assert writer.lengths()["payloads"] == lengths["payloads"] and writer.tensors == lengths["tensors"]
    assert writer.find_payload(payload_mod.content_key(np.arange(4.0, dtype=np.float32).view(np.uint32), 2)) == 0
    replacement = torch.arange(10.0, 14.0)
    extra = replacement.numpy().view(np.uint32)
    pid = writer.payload(payload_mod.content_key(extra, 2), extra)
    writer.late(0, pid)  # the first record (the input, 4 floats) now points to these bytes
    writer.close("crashed", {"died": "test"})
    run_reader = RunReader(str(path))
    rank = run_reader.rank(0)
    assert run_reader.status == "crashed" and len(rank) == lengths["steps"] == 1
    assert pid == lengths["payloads"]
    first = rank.tensor_records(0)[0]
    assert first.payload == pid and torch.equal(rank.tensor(first), replacement)  # the late row wins
    (output,) = rank.tensor_records(0)[1:]
    assert torch.equal(rank.tensor(output), torch.arange(4.0) * 2)
