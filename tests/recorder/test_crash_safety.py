"""Crash safety of recordings: a recorder killed with SIGKILL leaves a store that opens and shows
exactly its committed steps, each readable, and never zeros standing in for data that was not written.

The recording processes run tests/recorder/crash_child.py; every tensor they record is derived from
the iteration number or the seed, so this file recomputes expected values without them.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import recorder
from recorder import payload as payload_mod
from recorder.errors import FormatError, NotARecordingError
from recorder.store import layout
from recorder.store.reader import RankReader, RunReader, TensorRecord
from tests.cli import env

if not hasattr(signal, "SIGKILL") or not hasattr(os, "fork"):
    pytest.skip("needs SIGKILL and fork (POSIX)", allow_module_level=True)

CHILD_SCRIPT = Path(__file__).with_name("crash_child.py")
_spec = importlib.util.spec_from_file_location("pdbg_crash_child", CHILD_SCRIPT)
assert _spec is not None and _spec.loader is not None
child = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(child)

KILLS = 20
PARALLEL = 4
SEED = 20240607
MANIFEST_WAIT_S = 90.0
# One intra-op thread per child: several children share few cores, and spinning OpenMP threads
# would starve them (the kill should land while they record, not while they wait for a core).
CHILD_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


# -- reference: what one iteration of a child records --------------------------------------------
def _step_signature(rank: RankReader, i: int, base: int) -> tuple[Any, ...]:
    """What a step must look like wherever it is recorded: names, structure and tensor metadata."""
    col = rank.column

    def rel(v: Any) -> int:
        return int(v) - base if int(v) != layout.NO_REF else layout.NO_REF

    tensors = tuple((r.role, r.name, r.dtype, r.shape, r.requires_grad) for r in rank.tensor_records(i))
    return (rank.doc(int(col("steps/name")[i])), rank.doc(int(col("steps/module_path")[i])),
            int(col("steps/phase")[i]), int(col("steps/call")[i]), rel(col("steps/parent")[i]),
            rel(col("steps/forward")[i]), tensors)


_PATTERNS: dict[tuple[int, int], list[tuple[Any, ...]]] = {}


def iteration_pattern(seed: int, tmp: Path) -> list[tuple[Any, ...]]:
    """Signatures of the steps of one iteration of child ``seed``, from a 3-iteration recording made
    here; checks that every iteration records the same steps."""
    cfg = child.config(seed)
    key = (cfg["width"], cfg["probes"])
    if key not in _PATTERNS:
        path = tmp / f"reference-{key[0]}-{key[1]}"
        model, opt = child.build(seed)
        with recorder.record(str(path), model=model, optimizer=opt, mode="full"):
            for it in range(3):
                child.train_iteration(model, opt, it, cfg["probes"])
        rank = RunReader(str(path)).rank(0)
        assert len(rank) % 3 == 0
        per = len(rank) // 3
        its = [[_step_signature(rank, it * per + j, it * per) for j in range(per)] for it in range(3)]
        assert its[0] == its[1] == its[2], "the reference iterations differ"
        assert list(rank.column("steps/iteration")) == [it for it in range(3) for _ in range(per)]
        _PATTERNS[key] = its[0]
    return _PATTERNS[key]


# -- running and killing children ------------------------------------------------------------------
def record_and_kill(path: Path, seed: int, delay: float, after_steps: bool = False) -> dict[str, Any]:
    """Start a recording child, wait for its store's first commit (``after_steps``: and a later one, which holds
    steps, however slowly a loaded machine runs the child), let it run ``delay`` s, SIGKILL it."""
    log = path.with_suffix(".log")
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, str(CHILD_SCRIPT), str(path), str(seed)],
                                stdout=out, stderr=subprocess.STDOUT, env=CHILD_ENV)
    try:
        deadline = time.monotonic() + MANIFEST_WAIT_S
        while not (path / layout.MANIFEST_KEY).exists():
            if proc.poll() is not None:
                raise AssertionError(f"child {seed} exited ({proc.returncode}) before its first commit:\n"
                                     f"{log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"child {seed} made no manifest in {MANIFEST_WAIT_S:.0f} s")
            time.sleep(0.005)
        first = (path / layout.MANIFEST_KEY).stat().st_mtime_ns
        while after_steps and (path / layout.MANIFEST_KEY).stat().st_mtime_ns == first:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"child {seed} made no commit after its first in {MANIFEST_WAIT_S:.0f} s "
                                     f"(exit {proc.returncode})")
            time.sleep(0.005)
        time.sleep(delay)
        alive = proc.poll() is None
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert alive, f"child {seed} died by itself ({proc.returncode}):\n" + log.read_text()[-3000:]
    assert proc.returncode == -signal.SIGKILL
    return {"seed": seed, "path": path, "delay": delay, "pid": proc.pid}


# -- checking a store ------------------------------------------------------------------------------
class FastPayloads:
    """Payload tensors from whole committed blob columns (read once), to check every record quickly;
    the reader's own ``rank.tensor`` is compared against it on a sample."""

    def __init__(self, rank: RankReader) -> None:
        self.rank = rank
        self.blobs: dict[int, np.ndarray] = {}

    def units(self, pid: int) -> tuple[np.ndarray, int]:
        rank = self.rank
        assert 0 <= pid < rank.lengths["payloads"]
        unit = int(rank.column("payloads/blob")[pid])
        if unit not in self.blobs:
            self.blobs[unit] = rank.column(f"blobs/{layout.BLOB_UNITS[unit]}")
        offset, count = int(rank.column("payloads/offset")[pid]), int(rank.column("payloads/count")[pid])
        blob = self.blobs[unit]
        assert 0 <= offset and offset + count <= len(blob), f"payload {pid} lies past the committed blob"
        return blob[offset:offset + count], unit

    def tensor(self, rec: TensorRecord) -> torch.Tensor:
        units, _ = self.units(rec.payload)
        return payload_mod.from_units(units, payload_mod.dtype_from_name(rec.dtype), rec.shape)


def check_stats(t: torch.Tensor, rec: TensorRecord, where: str) -> None:
    """The payload agrees with the statistics recorded with it (computed before it was written)."""
    s = rec.stats
    assert t.dtype == torch.float32, where
    # Recomputed in float64 with numpy (torch reduced in float32); no BLAS, which is slow here.
    v = t.reshape(-1).numpy().astype(np.float64)
    assert s["nan"] == 0 and s["inf"] == 0, where
    assert v.size > 0, where
    lo, hi = float(v.min()), float(v.max())
    assert (lo, hi) == (s["min"], s["max"]), f"{where}: {s} vs payload min {lo} max {hi}"  # exact
    assert max(abs(lo), abs(hi)) == s["absmax"], where
    tol = 1e-6 * s["absmax"]
    assert math.isclose(float(v.mean()), s["mean"], rel_tol=1e-5, abs_tol=tol), f"{where}: mean {s}"
    assert math.isclose(math.sqrt(float(np.square(v).sum())), s["norm"], rel_tol=1e-5), f"{where}: norm {s}"
    if v.size > 1:
        assert math.isclose(float(v.std(ddof=1)), s["std"], rel_tol=1e-4, abs_tol=tol), f"{where}: std {s}"
    if s["absmax"] > 0:
        assert bool(np.any(v != 0)), f"{where}: payload is all zeros, its statistics say absmax={s['absmax']}"


def check_store(path: Path, seed: int, tmp: Path, rng: random.Random) -> int:
    """Every check of the acceptance point on one killed store; returns its committed steps."""
    run = RunReader(str(path))
    manifest = json.loads((path / layout.MANIFEST_KEY).read_text())
    assert manifest["status"] == "recording"  # as the killed writer left it
    assert run.status == "crashed", "a dead writer's run must read as crashed"
    assert run.ranks == [0]
    rank = run.rank(0)
    committed = manifest["ranks"]["0"]
    n = len(rank)
    assert n == committed["steps"]

    # Every committed document decodes, every committed payload hashes to its recorded content key.
    for doc_id in range(committed["docs"]):
        rank.doc(doc_id)
    fast = FastPayloads(rank)
    hashes = rank.column("payloads/hash")
    for pid in range(committed["payloads"]):
        units, unit = fast.units(pid)
        hi, lo, _ = payload_mod.content_key(units, unit)
        assert (hi, lo) == (int(hashes[pid][0]), int(hashes[pid][1])), \
            f"{path}: payload {pid} ({len(units)} units) does not match its hash (unwritten bytes?)"

    cfg = child.config(seed)
    width, pattern = cfg["width"], iteration_pattern(seed, tmp)
    per = len(pattern)
    initial = dict(child.build(seed)[0].named_parameters())
    iterations = rank.column("steps/iteration")
    statuses = rank.column("steps/status")
    last_rows = set(range(max(0, rank.lengths["tensors"] - 40), rank.lengths["tensors"]))
    outputs: dict[tuple[int, str], torch.Tensor] = {}
    for i in range(n):
        it, base = i // per, (i // per) * per
        assert int(iterations[i]) == it, f"{path}: step {i} has iteration {iterations[i]}, expected {it}"
        assert layout.STATUSES[int(statuses[i])] == "ok"
        sig = _step_signature(rank, i, base)
        assert sig == pattern[i - base], f"{path}: step {i} is {sig}, expected {pattern[i - base]}"
        name, module_path, phase, call = sig[:4]
        assert rank.doc(int(rank.column("steps/definition")[i]))["name"] == name
        assert rank.doc(int(rank.column("steps/settings")[i])) is not None
        args = rank.doc(int(rank.column("steps/args")[i]))
        for rec in rank.tensor_records(i):
            where = f"{path}: step {i} ({name} {module_path!r} phase {phase} it {it}) {rec.role} {rec.name}"
            assert rec.step == i and rec.has_payload, where
            t = fast.tensor(rec)
            check_stats(t, rec, where)
            if rec.row in last_rows or rng.random() < 0.02:  # the reader's own path, on a sample
                assert torch.equal(rank.tensor(rec), t), where
            # Values known without the child.
            x = child.input_for(it, width)
            if phase == 0 and name == "Affine" and module_path == "a" and rec.role == "input":
                assert torch.equal(t, x), f"{where}: not the input of iteration {it}"
            if phase == 0 and name == "probe":
                k = child.probe_factor(call)
                assert args["args"][1] == k, where
                expected = x[:, call:call + 4] * (k if rec.role == "output" else 1.0)
                assert torch.equal(t, expected), f"{where}: not the probe slice of iteration {it}"
            if phase == 0 and it == 0 and rec.role == "param":
                assert torch.equal(t, initial[f"{module_path}.{rec.name}"].detach()), where
            if phase == 0 and name == "Affine" and module_path == "a" and rec.role == "output":
                outputs[(it, "a")] = t
            if phase == 0 and name == "smooth" and rec.role == "input" and (it, "a") in outputs:
                assert torch.equal(t, outputs[(it, "a")]), f"{where}: not Affine a's output"
    return n


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigkill_at_random_moments_leaves_committed_steps_readable(tmp_path: Path) -> None:
    """20 runs SIGKILLed at random moments open as crashed with exactly their committed, correct steps."""
    rng = random.Random(SEED)
    # every fourth after a commit of steps: on a loaded machine a child may commit none in the others' 3 s
    jobs = [(tmp_path / f"run-{k}.zarr", rng.randrange(1 << 30), rng.uniform(0.3, 3.0), k % 4 == 3)
            for k in range(KILLS)]
    t0 = time.monotonic()
    results: list[dict[str, Any]] = []
    with ThreadPoolExecutor(max_workers=PARALLEL) as pool:
        futures = [pool.submit(record_and_kill, *job) for job in jobs]
        for future in as_completed(futures):
            result = future.result()
            seed = result["seed"]
            result["steps"] = check_store(result["path"], seed, tmp_path, random.Random(seed))
            shutil.rmtree(result["path"])  # pass: keep the disk small (failing stores stay for a look)
            results.append(result)
    results.sort(key=lambda r: r["delay"])
    summary = ", ".join(f"{r['delay']:.2f}s:{r['steps']}" for r in results)
    print(f"\n{KILLS} kills in {time.monotonic() - t0:.1f} s; delay:committed steps = {summary}")
    assert len(results) == KILLS
    assert sum(r["steps"] for r in results) > 0, "no kill left a committed step: the test checked nothing"


def test_sigkill_before_first_commit_opens_empty_or_raises_a_format_error(tmp_path: Path) -> None:
    """A run killed before its first commit opens with 0 steps or raises a one-line FormatError."""
    proc = subprocess.run([sys.executable, str(CHILD_SCRIPT), "--early", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.split("\n")
    assert lines[0].startswith("setup ")
    setup = int(lines[0].split()[1])  # write events up to and including the first commit
    assert setup > 10
    outcomes = dict(line.split(" ", 1) for line in lines[1:] if line)
    assert len(outcomes) > 20
    opened = raised = 0
    for point, outcome in outcomes.items():
        n = int(point)
        assert outcome == "SIGKILL", f"kill point {n}: the child ended by {outcome!r}, not by its SIGKILL"
        path = tmp_path / f"kill-{n}"
        try:
            run = RunReader(str(path))
        except (FormatError, NotARecordingError) as exc:
            message = str(exc)
            assert message and "\n" not in message, f"kill point {n}: {message!r}"
            assert n < setup, f"kill point {n} is past the first commit, yet it does not open: {message}"
            raised += 1
            continue
        assert run.status == "crashed", f"kill point {n}"
        rank = run.rank(0)
        assert len(rank) == 0, f"kill point {n}: {len(rank)} steps"
        assert len(rank.column("steps/name")) == 0 and len(rank.column("tensors/step")) == 0
        opened += 1
    assert raised > 0 and opened > 0, (raised, opened)


TERMINATED = """
import os, signal, sys
import torch, torch.nn as nn
import recorder

out, mode, how = sys.argv[1:]
if how == "own_handler":  # the program's: it ends the process at once, closing nothing
    signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(7))
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
with recorder.record(out, optimizer=opt, mode=mode, modules="*", flush_interval=3600):  # no commit of its own
    for i in range(6):
        model(torch.randn(3, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    os.kill(os.getpid(), signal.SIGTERM)  # a preempted job
    print("went on", flush=True)
"""


@pytest.mark.parametrize("mode, how", [("full", "default"), ("stats", "default"), ("full", "own_handler")])
def test_sigterm_commits_what_was_recorded_in_every_mode(tmp_path: Path, mode: str, how: str) -> None:
    """Full and stats mode ignored SIGTERM: the steps since the last commit (up to a second of them)
    and the closing metadata were lost, and the run read "the process ended without closing the
    recording". Now, as in flight mode: the recording is committed and closed, crashed by SIGTERM,
    before the signal ends the process; under a handler of the program's own, committed, then the
    handler decides."""
    script = tmp_path / "terminated.py"
    script.write_text(TERMINATED)
    out = tmp_path / "run.zarr"
    res = subprocess.run([sys.executable, str(script), str(out), mode, how], capture_output=True, text=True,
                         timeout=300, check=False, env=env())
    assert res.returncode == (7 if how == "own_handler" else -signal.SIGTERM), res.stderr[-3000:]
    assert "went on" not in res.stdout
    import replayer

    rec = replayer.open(out)
    assert rec.status == "crashed"
    assert {s.iteration for s in rec.steps} == set(range(6)) and len(rec.steps) == 6 * 3 * 2
    assert rec.ended_by == ("SIGTERM" if how == "default" else
                            "the process ended without closing the recording (killed, or it died)")
