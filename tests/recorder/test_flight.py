"""Flight mode: statistics always, payloads of the last `keep` iterations only when something happens."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

import recorder
from recorder.errors import RecordingError
from recorder.store.reader import RunReader
from tests.sealing import write_sealed

ROOT = Path(__file__).resolve().parents[2]


def payload_iterations(path: Path) -> tuple[set[int], set[int]]:
    """(iterations with any step recorded, iterations whose activations all have their bytes).

    Activations (inputs, outputs, gradients) are new in every iteration; parameters may repeat the
    bytes of an iteration that was kept (an update skipped), and then rightly point to them."""
    rank = RunReader(str(path)).rank(0)
    seen: dict[int, list[bool]] = {}
    for step in range(len(rank)):
        it = int(rank.column("steps/iteration")[step])
        seen.setdefault(it, []).extend(rec.has_payload for rec in rank.tensor_records(step)
                                       if rec.role not in ("param", "buffer"))
    partial = {it for it, flags in seen.items() if any(flags) and not all(flags)}
    assert not partial, f"iterations with only some payloads: {sorted(partial)}"
    return set(seen), {it for it, flags in seen.items() if all(flags)}


def train(run: recorder.run.Run, iterations: int, nan_at: int | None, model: nn.Module) -> list[torch.Tensor]:
    """A loop that skips the update on a non-finite loss (so one NaN does not poison what follows)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs = []
    for i in range(iterations):
        x = torch.randn(3, 4)
        if i == nan_at:
            x[0, 0] = float("nan")
        inputs.append(x)
        loss = model(x).pow(2).mean()
        loss.backward()
        if torch.isfinite(loss):
            opt.step()
        opt.zero_grad()
        run.next_iteration()
    return inputs


def small_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


class TestFlight:
    def test_nan_at_40_keeps_39_and_40_and_the_ring_at_exit(self, run_path: Path) -> None:
        """50 iterations, keep=2, NaN at 40: statistics for all 50, payloads for 39-40 and for 48-49
        (still in the ring at the end), nothing else; the kept bytes are exact."""
        model = small_model()
        with recorder.record(run_path, mode="flight", keep=2, modules="*") as run:
            inputs = train(run, 50, 40, model)
        recorded, kept = payload_iterations(run_path)
        assert recorded == set(range(50))
        assert kept == {39, 40, 48, 49}
        rank = RunReader(str(run_path)).rank(0)
        first = [s for s in range(len(rank)) if int(rank.column("steps/iteration")[s]) == 40][0]
        (x,) = [r for r in rank.tensor_records(first) if r.role == "input"]
        assert torch.equal(rank.tensor(x).view(torch.int32), inputs[40].view(torch.int32))  # bitwise, NaN too
        final = RunReader(str(run_path)).attrs["final"]["flight"]
        assert [d["reason"] for d in final["dumps"]] == ["nonfinite", "end"]
        assert [d["iterations"] for d in final["dumps"]] == [[39, 40], [48, 49]]
        assert 0 < final["peak_ring_bytes"] <= 3 * final["dumps"][0]["bytes"]

    def test_a_resumed_run_keeps_the_ring_by_the_runs_own_iteration_numbers(self, run_path: Path) -> None:
        """A run resumed at step 100 (start_iteration=100), NaN at its step 104: the ring keeps 103 and
        104 and names them so, as the uninterrupted run would (the recording numbered them 3 and 4)."""
        model = small_model()
        with recorder.record(run_path, mode="flight", keep=2, modules="*", start_iteration=100) as run:
            inputs = train(run, 8, 4, model)
        recorded, kept = payload_iterations(run_path)
        assert recorded == set(range(100, 108)) and kept == {103, 104, 106, 107}
        rank = RunReader(str(run_path)).rank(0)
        assert [d["iterations"] for d in rank.final["flight"]["dumps"]] == [[103, 104], [106, 107]]
        assert rank.final["iterations"] == 9 and rank.run_info["start_iteration"] == 100  # 100..108 begun
        first = [s for s in range(len(rank)) if int(rank.column("steps/iteration")[s]) == 104][0]
        (x,) = [r for r in rank.tensor_records(first) if r.role == "input"]
        assert torch.equal(rank.tensor(x).view(torch.int32), inputs[4].view(torch.int32))

    def test_exception_writes_the_ring(self, run_path: Path) -> None:
        """An exception escaping a step writes the ring: the iterations before the crash keep their bytes."""
        class Fragile(nn.Module):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                if x.abs().max() > 100:
                    raise OverflowError("too big")
                return x * 2

        model = nn.Sequential(nn.Linear(4, 4), Fragile())
        with pytest.raises(OverflowError), recorder.record(run_path, mode="flight", keep=3, modules="*") as run:
            for i in range(10):
                model(torch.randn(2, 4) * (1000 if i == 6 else 1))
                run.next_iteration()
        recorded, kept = payload_iterations(run_path)
        assert recorded == set(range(7)) and kept == {4, 5, 6}
        assert RunReader(str(run_path)).status == "crashed"

    def test_an_exception_between_steps_is_named_as_the_rings_write_out(self, run_path: Path) -> None:
        """An exception raised by the loop between steps (no step open) wrote the ring at the close as
        "end", and pdbg info said "written out at: end" of a run that crashed; it now says "exception",
        and a normal end keeps "end"."""
        import replayer
        from tui.cmd_replay import summary

        model = small_model()
        with pytest.raises(RuntimeError, match="loader broke"), \
                recorder.record(run_path, mode="flight", keep=2, modules="*") as run:
            for i in range(5):
                model(torch.randn(3, 4)).pow(2).mean().backward()
                if i == 3:
                    raise RuntimeError("loader broke")
                run.next_iteration()
        rank = RunReader(str(run_path)).rank(0)
        assert rank.status == "crashed"
        assert rank.final["flight"]["dumps"] == [{"reason": "exception", "iterations": [2, 3],
                                                  "bytes": rank.final["flight"]["dumps"][0]["bytes"]}]
        assert summary(replayer.open(run_path))["tensors_kept"] == (
            "iterations 2, 3 (the flight ring, written out at: exception)")
        ended = run_path.parent / "ended.zarr"
        with recorder.record(ended, mode="flight", keep=2, modules="*") as run:
            train(run, 4, None, small_model())
        assert summary(replayer.open(ended))["tensors_kept"] == "iterations 2, 3 (the flight ring, written out at: end)"

    def test_ring_is_bounded_in_bytes(self, run_path: Path) -> None:
        """max_ring_bytes caps the ring: older iterations are dropped first; the peak is reported."""
        model = small_model()
        with recorder.record(run_path, mode="flight", keep=10, max_ring_bytes=2000, modules="*") as run:
            train(run, 12, None, model)
        _, kept = payload_iterations(run_path)
        final = RunReader(str(run_path)).attrs["final"]["flight"]
        assert final["peak_ring_bytes"] <= 2000
        assert kept and max(kept) == 11 and len(kept) < 10

    def test_a_tensor_changed_in_place_after_its_step_keeps_its_recorded_values(self, run_path: Path) -> None:
        """The ring holds copies: a step's output changed in place afterwards (`h += x`, common in
        residual code) is written as it was when the step returned."""
        @recorder.paper_step("Eq. 9")
        def double(x: torch.Tensor) -> torch.Tensor:
            return x * 2

        x = torch.full((4,), 3.0)
        with recorder.record(run_path, mode="flight", keep=2):
            h = double(x)
            h += x  # after the step
        rank = RunReader(str(run_path)).rank(0)
        recs = {r.role: r for r in rank.tensor_records(0)}
        assert torch.equal(rank.tensor(recs["output"]), torch.full((4,), 6.0))
        assert torch.equal(h, torch.full((4,), 9.0))

    def test_bad_keep_is_refused(self, run_path: Path) -> None:
        with pytest.raises(RecordingError, match="keep must be a positive integer"):
            recorder.record(run_path, mode="flight", keep=0)
        assert not run_path.exists()

    def test_options_of_another_mode_are_refused_not_ignored(self, run_path: Path, tmp_path: Path) -> None:
        """keep and max_ring_bytes outside flight mode, every outside full mode: each did nothing,
        silently (a user asking for keep=50 in full mode believed the last 50 iterations were kept)."""
        from recorder.framework import FrameworkCallback
        from tests.cli import pdbg

        refusals = [({"mode": "full", "keep": 5}, "keep=5 applies to mode='flight'"),
                    ({"mode": "stats", "max_ring_bytes": 1 << 20}, "max_ring_bytes=1048576 applies to mode='flight'"),
                    ({"mode": "stats", "every": 2}, "every=2 applies to mode='full' (payloads every k-th iteration); "
                                                    "mode='stats' keeps no payload"),
                    ({"mode": "flight", "every": 3}, "every=3 applies to mode='full'")]
        for options, message in refusals:
            with pytest.raises(RecordingError, match=re.escape(message)):
                recorder.record(run_path, **options)
            assert not run_path.exists()
        with pytest.raises(RecordingError, match=re.escape("keep=4 applies to mode='flight'")):
            FrameworkCallback(run_path, mode="stats", keep=4)
        script = tmp_path / "train.py"
        script.write_text("print('trained')\n")
        for flags, message in ((["--keep", "3"], "--keep applies to --mode flight"),
                               (["--mode", "stats", "--every", "2"], "--every applies to --mode full"),
                               (["--mode", "flight", "--every", "2"], "--every applies to --mode full")):
            res = pdbg("record", "-o", str(run_path), *flags, "--", str(script), cwd=tmp_path)
            assert res.returncode == 2 and res.stderr.startswith(f"pdbg: error: {message}"), res.stderr
            assert res.stderr.count("\n") == 1, res.stderr
            assert "trained" not in res.stdout and not run_path.exists()


CHILD = """
import sys, time
import torch, torch.nn as nn
import recorder

model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
with recorder.record(sys.argv[1], optimizer=opt, mode="flight", keep=2, modules="*"):
    i = 0
    while True:
        model(torch.randn(3, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        print("iteration", i, flush=True)
        i += 1
"""


@pytest.mark.timeout(120)
def test_sigterm_writes_the_ring_before_exiting(tmp_path: Path) -> None:
    """SIGTERM during flight recording: the ring's last two iterations are on disk, then the process
    ends by the signal as it would have; the run is crashed."""
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD))
    path = tmp_path / "run.zarr"
    proc = subprocess.Popen([sys.executable, str(script), str(path)], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.stdout is not None
    for line in proc.stdout:  # blocks until the child has trained a few iterations
        if line.strip() == "iteration 5":
            break
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM
    assert_ring_written_on_sigterm(path)


def assert_ring_written_on_sigterm(path: Path) -> None:
    """A run stopped by SIGTERM after iteration 5: crashed, its last two iterations' payloads kept."""
    run = RunReader(str(path))
    assert run.status == "crashed"
    recorded, kept = payload_iterations(path)
    last = max(recorded)
    assert last >= 5 and kept and kept <= {last - 1, last} and max(kept) == last
    assert run.attrs["final"]["flight"]["dumps"][0]["reason"] == "SIGTERM"


EARLY = """
import os, signal, sys
import torch, torch.nn as nn
import recorder

model = nn.Sequential(nn.Linear(4, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with recorder.record(sys.argv[1], model=model, optimizer=opt, mode="flight", modules="*"):
    os.kill(os.getpid(), signal.SIGTERM)  # preempted while loading, before the first step
    model(torch.randn(2, 4)).sum().backward()
"""


@pytest.mark.timeout(120)
def test_sigterm_before_the_first_step_says_so(tmp_path: Path) -> None:
    """SIGTERM before the first step (a job preempted while loading its checkpoint) left the flight
    recording crashed with no reason (its ring wrote out nothing, and only a ring write named the
    signal); one step later it said "ended by: SIGTERM". Now it says so either way."""
    script = tmp_path / "early.py"
    script.write_text(EARLY)
    path = tmp_path / "run.zarr"
    res = subprocess.run([sys.executable, str(script), str(path)], capture_output=True, text=True, timeout=120,
                         check=False, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert res.returncode == -signal.SIGTERM, res.stderr[-2000:]
    import replayer

    rec = replayer.open(path)
    assert (rec.status, rec.ended_by, len(rec.steps)) == ("crashed", "SIGTERM", 0)
    assert rec.reader.attrs["final"]["signal"] == "SIGTERM"


POISONED = """
import torch, torch.nn as nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for i in range(6):
    x = torch.randn(3, 4)
    if i == 3:
        x[0, 0] = float("nan")  # its update makes every weight NaN: from then on each step is all NaN
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.timeout(300)
def test_pdbg_info_names_every_iteration_a_flight_recording_kept(tmp_path: Path) -> None:
    """Under `pdbg record --mode flight` (the ring in shared memory: every payload taken by content),
    an iteration whose payloads all repeated bytes written out already (NaN after NaN) was left out
    of the ring's write-outs: `pdbg info` said "iterations 2, 3" while 4 and 5 had their tensors and
    replayed. Both paths, pdbg's child process and a recording in this process, now name exactly the
    iterations whose tensors are in the store, and why_statistics_only names them too."""
    import json

    from recorder.runner import run_script
    from tests.cli import pdbg, pdbg_here

    script = tmp_path / "poisoned.py"
    script.write_text(POISONED)
    modules = ["1", "2"]  # the Tanh and the last Linear: their inputs are all NaN after iteration 3
    res = pdbg("record", "-o", "child.zarr", "--mode", "flight", "--modules", *modules, "--", str(script),
               cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    in_process = tmp_path / "here.zarr"
    assert run_script(script, [], in_process, mode="flight", modules=modules).status == "complete"
    for path in (tmp_path / "child.zarr", in_process):
        recorded, kept = payload_iterations(path)
        assert recorded == set(range(6)) and kept == {2, 3, 4, 5}, path
        rank = RunReader(str(path)).rank(0)
        assert rank.ring_iterations() == [2, 3, 4, 5], path
        info = pdbg_here("info", str(path), "--json", cwd=tmp_path)
        assert json.loads(info.stdout)["tensors_kept"] == (
            "iterations 2, 3, 4, 5 (the flight ring, written out at: nonfinite)"), info.stdout + info.stderr
        first = [s for s in range(len(rank)) if int(rank.column("steps/iteration")[s]) == 0][0]
        unkept = [r for r in rank.tensor_records(first) if not r.has_payload][0]
        assert rank.why_statistics_only(unkept) == (
            "flight mode keeps the tensors of the iterations its ring wrote out (2, 3, 4, 5), and iteration 0 is "
            "not one of them")


VALIDATION = """
import sys
import torch, torch.nn as nn

torch.manual_seed(0)
torch.set_num_threads(1)
model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 8, 3, padding=1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
calls = []  # every module call's tensors, as this script saw them, in the order the calls started


def saw(module, inputs):
    calls.append({"args.0": inputs[0].detach().clone(),
                  **{n: p.detach().clone() for n, p in module.named_parameters(recurse=False)}})


def gave(module, inputs, output):
    calls[-1]["output"] = output.detach().clone()  # (the children are leaves: the last call started is this one)


for child in model:
    child.register_forward_pre_hook(saw)
    child.register_forward_hook(gave)
valid = torch.randn(2, 3, 8, 8)  # a fixed validation batch, evaluated every other iteration
for i in range(5):
    model(torch.randn(2, 3, 8, 8)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    if i % 2 == 1:
        with torch.no_grad():
            model(valid)
torch.save({"calls": calls, "valid": valid}, sys.argv[1])
"""


def bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(torch.uint8).numpy().tobytes()


def assert_every_payload_is_its_own(path: Path, calls: list[dict[str, torch.Tensor]]) -> int:
    """Every tensor record with bytes reads (its checksum holds), and a forward step's are bitwise what
    the script saw at that call (``calls``, in the order the forward steps started). Returns how many
    forward records were compared."""
    rank = RunReader(str(path)).rank(0)
    forward = [s for s in range(len(rank)) if int(rank.column("steps/phase")[s]) == 0]
    assert len(forward) == len(calls)
    compared = 0
    for step in range(len(rank)):
        for record in rank.tensor_records(step):
            if record.has_payload:
                value = rank.tensor(record)  # (ChecksumError: bytes of another tensor)
                if step in forward and record.name in calls[forward.index(step)]:
                    assert bits(value) == bits(calls[forward.index(step)][record.name]), (step, record.name)
                    compared += 1
    return compared


@pytest.mark.timeout(300)
def test_pdbg_record_keeps_a_batch_that_recurs_every_keep_iterations_as_recorded(tmp_path: Path) -> None:
    """`pdbg record --mode flight` (the ring in shared memory, every payload taken by content) of a
    fixed validation batch evaluated every other iteration, keep=2: its bytes, found held by the
    iteration two back, were held again for the new iteration after that one had been dropped and
    its block handed back, and the next payload's copy overwrote them. The payload written out held
    a later tensor's bytes, and pdbg verify, replay and Step.tensor said the recording was corrupted.
    Now every record's bytes are those the script saw, the batch's included, and it verifies."""
    import json

    from tests.cli import pdbg, pdbg_here

    script = tmp_path / "validation.py"
    script.write_text(VALIDATION)
    res = pdbg("record", "-o", "run.zarr", "--mode", "flight", "--keep", "2", "--modules", "*", "--",
               str(script), "saw.pt", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    saved = torch.load(tmp_path / "saw.pt")
    rank = RunReader(str(tmp_path / "run.zarr")).rank(0)
    assert rank.ring_iterations() == [3, 4]
    valid = [s for s in range(len(rank)) if int(rank.column("steps/iteration")[s]) == 4
             and int(rank.column("steps/phase")[s]) == 0][0]  # the batch's first call at iteration 4
    (args,) = [r for r in rank.tensor_records(valid) if r.name == "args.0"]
    assert args.has_payload and bits(rank.tensor(args)) == bits(saved["valid"])
    assert assert_every_payload_is_its_own(tmp_path / "run.zarr", saved["calls"]) == 3 * (4 + 2 + 4)  # 3 passes
    verified = pdbg_here("verify", "run.zarr", "--json", cwd=tmp_path)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert json.loads(verified.stdout)["matched"] == 15


def test_a_frozen_weight_captured_every_keep_iterations_keeps_its_bytes(run_path: Path) -> None:
    """In this process too: a frozen 256 KB table (pooled staging buffers) whose step takes no tensor,
    called every other iteration as its first capture, keep=2. Its bytes, found held by the iteration
    two back, were held again after that iteration was dropped and their buffer given back; the next
    iteration's first copy took that buffer, and the table's payload held another tensor's bytes."""

    class Table(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(256, 256), requires_grad=False)

        def forward(self) -> torch.Tensor:
            return self.weight * 1

    torch.manual_seed(0)
    model = nn.ModuleDict({"table": Table(), "linear": nn.Linear(256, 256)})
    calls = []
    with recorder.record(str(run_path), model=model, mode="flight", keep=2, modules=["*"]) as run:
        for i in range(6):
            if i % 2 == 0:
                calls.append({"weight": model["table"].weight.detach().clone(), "output": model["table"]()})
            x = torch.randn(256, 256)
            calls.append({"args.0": x, "output": model["linear"](x).detach(),
                          **{n: p.detach().clone() for n, p in model["linear"].named_parameters()}})
            run.next_iteration()
    assert RunReader(str(run_path)).rank(0).ring_iterations() == [4, 5]
    assert assert_every_payload_is_its_own(run_path, calls) == 2 + 2 * 4


def test_a_schema_1_0_recording_without_late_payloads_still_reads(run_path: Path) -> None:
    """Recordings made before late/ existed (schema 1.0: no such arrays, no such length) read as before."""
    import json
    import shutil

    model = small_model()
    with recorder.record(run_path, modules="*") as run:
        train(run, 2, None, model)
    manifest_path = run_path / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["schema_version"] = "1.0"
    lengths = manifest["ranks"]["0"]
    for key in [k for k in lengths if k == "late" or k.startswith("late/")]:
        del lengths[key]
    write_sealed(manifest_path, manifest)
    shutil.rmtree(run_path / "rank0" / "late")
    rank = RunReader(str(run_path)).rank(0)
    recs = rank.tensor_records(0)
    assert recs and all(r.has_payload for r in recs)
    assert rank.tensor(recs[0]).shape == torch.Size([3, 4])


def test_ring_finds_held_bytes_until_the_last_iteration_holding_them_leaves() -> None:
    """The ring's lookup by content: bytes held by two iterations (a parameter that did not change)
    stay findable, and counted once, until both have left; bytes over the budget are never held."""
    import numpy as np

    from recorder.flight import FlightRing
    from recorder.items import PayloadItem

    def item(key: int, words: int = 4) -> PayloadItem:
        return PayloadItem(key=(key, key, 2), unit=2, data=np.zeros(words, np.uint32))

    ring = FlightRing(keep=2, max_bytes=64)
    weight, activation = item(1), item(2)
    assert ring.add(0, weight.key, weight) is None
    assert ring.add(0, activation.key, activation) is None
    assert ring.start_iteration(1) == ([], [])
    assert ring.find(weight.key) is weight
    assert ring.add(1, weight.key, ring.find(weight.key)) is None  # the same bytes, held again
    assert ring.bytes == weight.nbytes + activation.nbytes

    assert ring.start_iteration(2) == ([0], [activation])
    assert ring.find(activation.key) is None
    assert ring.find(weight.key) is weight
    assert ring.bytes == weight.nbytes

    too_big = item(3, words=64)
    assert ring.add(2, too_big.key, too_big) == ([1], [weight, too_big])  # room made, still too big
    assert ring.find(too_big.key) is None and ring.find(weight.key) is None
    assert ring.overflowed == 1 and ring.bytes == 0

    kept = item(4)
    ring.add(2, kept.key, kept)
    assert ring.take_all() == ([2], [kept])
    assert ring.find(kept.key) is None and ring.bytes == 0


def test_ring_keeps_the_last_iterations_whose_numbers_skip() -> None:
    """``keep`` counts the iterations the ring holds, not their numbers: iterations numbered 0, 2, 4
    (a framework's global step going up by two) keep two of them, as 0, 1, 2 would."""
    import numpy as np

    from recorder.flight import FlightRing
    from recorder.items import PayloadItem

    ring = FlightRing(keep=2, max_bytes=1 << 20)
    items = [PayloadItem(key=(k, k, 2), unit=2, data=np.full(4, k, np.uint32)) for k in range(3)]
    for iteration, item in zip((0, 2, 4), items, strict=True):
        ring.start_iteration(iteration)
        ring.add(iteration, item.key, item)
    assert ring.take_all() == ([2, 4], items[1:])


def test_a_closed_recording_keeps_no_buffers(run_path: Path) -> None:
    """What a flight recording allocated to stage and write its bytes (its staging buffers, the
    store's chunk buffers) is let go when it closes: a closed ``Run`` stays with whoever holds it (a
    framework callback keeps its last one), and would otherwise keep ~100 MB for the callbacks'
    GPT-2, one more each time a notebook trains again."""
    import gc
    import tracemalloc

    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256))  # 256 KB weights: pooled
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        run = recorder.record(str(run_path), model=model, mode="flight", keep=2, modules=["*"])
        pool = run.session.pipeline.pool
        with run:
            for _ in range(5):
                model(torch.randn(64, 256)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                run.next_iteration()
            assert pool.free_bytes > 0  # iterations that left the ring gave their buffers back
        gc.collect()
        kept = tracemalloc.take_snapshot().compare_to(before, "filename")
    finally:
        tracemalloc.stop()
    recorder_kept = sum(d.size_diff for d in kept if f"{os.sep}recorder{os.sep}" in d.traceback[0].filename)
    assert recorder_kept < 1 << 20, [str(d) for d in kept[:5]]  # 12 MB before: staging and chunk buffers
    assert pool.free_bytes == 0
    pool.give(np.empty(1 << 20, np.uint8))  # what a writer given up on hands back afterwards
    assert pool.free_bytes == 0


def test_bytes_found_in_the_ring_are_held_again_under_the_same_lock(run_path: Path) -> None:
    """A frozen weight's bytes repeat at every iteration and are found in the ring. Finding them and
    holding them for the new iteration happen under one acquisition of the ring's lock: a capture on
    another thread that starts an iteration in between would drop them and hand their buffer back
    for reuse while they are still held."""
    import threading

    class Tracking:
        def __init__(self) -> None:
            self.inner, self.depth = threading.RLock(), 0

        def __enter__(self) -> None:
            self.inner.acquire()
            self.depth += 1

        def __exit__(self, *exc: object) -> None:
            self.depth -= 1
            self.inner.release()

    model = recorder.annotate(nn.Linear(32, 32), "Eq. 1").requires_grad_(False)
    x = torch.randn(4, 32)
    found_again: list[int] = []
    with recorder.record(str(run_path), model=model, mode="flight", keep=2) as run:
        ring = run.session.ring
        ring.lock = Tracking()
        add = ring.add

        def tracked_add(iteration, ref, item):  # type: ignore[no-untyped-def]
            if ring.find(ref) is item:  # held by an earlier iteration: found, and held again
                found_again.append(ring.lock.depth)
            return add(iteration, ref, item)

        ring.add = tracked_add
        for _ in range(4):
            model(x)
            run.next_iteration()
    assert len(found_again) >= 6  # weight and bias, iterations 1-3
    assert all(depth >= 1 for depth in found_again), found_again


def test_bytes_captured_after_an_optimizer_step_inside_a_step_reach_its_record(run_path: Path) -> None:
    """A step whose call runs the optimizer: its record belongs to the iteration it started in, but
    what it captures after the optimizer step is held in the ring under the next iteration. Those
    bytes reach the record when the ring is written, though the step's own iteration has left the
    ring, and the writer keeps nothing for them once written."""
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @recorder.paper_step("Algorithm 1", step=3, name="update")
    def update(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).square().mean()
        loss.backward()
        opt.step()  # the next iteration starts here
        opt.zero_grad()
        return loss.detach() * 2  # captured in it

    xs = [torch.randn(3, 4) for _ in range(6)]
    with recorder.record(run_path, model=model, optimizer=opt, mode="flight", keep=2) as run:
        outs = [update(x) for x in xs]
    assert not run.pipeline._tokens and not run.pipeline._waiting
    rank = RunReader(str(run_path)).rank(0)
    assert [int(i) for i in rank.column("steps/iteration")] == list(range(6))
    records = [{r.role: r for r in rank.tensor_records(step)} for step in range(6)]
    # At the end the ring holds iterations 5 and 6: the input of call 5, and the outputs of calls 4
    # (its record is in iteration 4, which left the ring) and 5.
    assert [r["input"].has_payload for r in records] == [False] * 5 + [True]
    assert [r["output"].has_payload for r in records] == [False] * 4 + [True] * 2
    assert torch.equal(rank.tensor(records[4]["output"]), outs[4])
    assert torch.equal(rank.tensor(records[5]["output"]), outs[5])
    assert torch.equal(rank.tensor(records[5]["input"]), xs[5])


def test_verify_of_a_flight_recording_replays_its_ring_and_passes(tmp_path: Path) -> None:
    """`pdbg verify` on a healthy flight recording: the steps outside the ring kept statistics only
    and are counted as such, not as mismatches; the ring's steps replay bitwise; exit 0."""
    import json

    from tests.cli import pdbg_here

    path = tmp_path / "run.zarr"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with recorder.record(path, model=model, optimizer=opt, mode="flight", keep=2, modules=["*"]):
        for _ in range(5):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
    res = pdbg_here("verify", str(path), "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert doc["mismatches"] == [] and doc["matched"] == doc["replayed"] == 2 * 2 * 2
    assert doc["statistics_only"] == 3 * 2 * 2


def test_a_recorder_failure_writes_out_the_iterations_the_ring_held_before_it(tmp_path: Path, monkeypatch) -> None:
    """Flight mode, keep=3, the recorder failing inside iteration 3 (its second step call): one
    warning says so and what was kept, training goes on, and the ring's iterations complete before
    the failure (1 and 2; 0 had left the ring) are written out, their steps replaying bit for bit,
    instead of being thrown away with the rest of the recording. The failure's own iteration is not
    (the step it failed in, and those after, are missing)."""
    import warnings

    import replayer
    from recorder import capture

    original = capture.Session._capture_inputs
    calls = []

    def flaky(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3 * 2 + 2:
            raise RuntimeError("simulated capture failure")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(capture.Session, "_capture_inputs", flaky)
    path = tmp_path / "run.zarr"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with recorder.record(path, model=model, optimizer=opt, mode="flight", keep=3, modules=["*"]) as run:
            for _ in range(6):
                model(torch.randn(3, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
    assert run.status == "incomplete" and len(calls) == 3 * 2 + 2
    messages = [str(w.message) for w in caught if "stopped recording" in str(w.message)]
    assert len(messages) == 1
    assert "the flight ring's tensors of iterations 1, 2 (complete before the failure) are written out" in messages[0]
    rank = RunReader(str(path)).rank(0)
    assert rank.ring_iterations() == [1, 2]
    assert [d["reason"] for d in rank.ring_writes()] == ["failure"]
    rec = replayer.open(path)
    kept = [s for s in rec.steps if s.iteration in (1, 2)]
    assert len(kept) == 2 * 4
    for step in kept:
        assert all(r.has_payload for r in step.records), step
        result = replayer.replay(rec, step.index)
        assert result.match, (step.index, result.outputs)
    assert not any(r.has_payload for s in rec.steps if s.iteration in (0, 3) for r in s.records if r.role == "input")


SIGNALLED = """
import os, signal, sys
import torch, torch.nn as nn
import recorder, recorder.pipeline as pipeline
from recorder.capture import Session

how = sys.argv[2]
calls = {"n": 0}
submit_bytes = pipeline.record_bytes
def inside_submit(item):  # called with the queue's lock held: a signal arriving at that bytecode
    calls["n"] += 1
    if how == "inside_submit" and calls["n"] == 60:
        os.kill(os.getpid(), signal.SIGTERM)
    return submit_bytes(item)
pipeline.record_bytes = inside_submit

dump_ring = Session.dump_ring
def dump_twice(self, reason):  # the group's copy and pdbg's forward of it: a second while the first is handled
    if how == "twice":
        os.kill(os.getpid(), signal.SIGTERM)
    return dump_ring(self, reason)
Session.dump_ring = dump_twice

close = pipeline.Pipeline.close
def close_interrupted(self, *args, **kwargs):  # a second signal while the recording closes
    if how in ("twice", "ctrl_c_twice"):
        os.kill(os.getpid(), signal.SIGTERM if how == "twice" else signal.SIGINT)
    return close(self, *args, **kwargs)
pipeline.Pipeline.close = close_interrupted

model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
try:
    with recorder.record(sys.argv[1], optimizer=opt, mode="flight", keep=2, modules="*") as run:
        for i in range(40):
            model(torch.randn(3, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if how in ("twice", "ctrl_c_twice", "hangup") and i == 20:
                os.kill(os.getpid(), {"twice": signal.SIGTERM, "hangup": signal.SIGHUP}.get(how, signal.SIGINT))
except KeyboardInterrupt:
    print("interrupted; closed", run.closed, run.status, flush=True)
    raise
"""


@pytest.mark.parametrize("how", ["inside_submit", "twice", "ctrl_c_twice", "hangup"])
def test_a_signal_at_any_moment_writes_the_ring_once_and_ends_the_process(tmp_path: Path, how: str) -> None:
    """A SIGTERM while training held the queue's lock hung the process for ever (the handler waited
    for the writer, which waited for the lock); a second SIGTERM while the first was handled (a
    signal to the process group, and pdbg's forward of it) or a second Ctrl-C while the recording
    closed cut the close in half: the ring was lost, the store left "recording". A SIGHUP (the
    terminal or ssh session closed) ended the process without writing the ring."""
    script = tmp_path / "child.py"
    script.write_text(SIGNALLED)
    out = tmp_path / "run.zarr"
    res = subprocess.run([sys.executable, str(script), str(out), how], capture_output=True, text=True, timeout=120,
                         check=False, env=dict(os.environ, PYTHONPATH=str(ROOT)))  # (this checkout's recorder)
    if how == "ctrl_c_twice":
        assert res.returncode == -signal.SIGINT and "interrupted; closed True crashed" in res.stdout, res.stderr[-2000:]
        assert res.stderr.rstrip().endswith("KeyboardInterrupt"), res.stderr[-2000:]
    else:
        assert res.returncode == -(signal.SIGHUP if how == "hangup" else signal.SIGTERM), res.stderr[-2000:]
    import replayer

    rec = replayer.open(out)
    assert rec.status == "crashed" and rec.ended_by in ("SIGTERM", "SIGHUP", "KeyboardInterrupt"), rec.ended_by
    kept = [s for s in rec.steps if all(r.has_payload for r in s.records)]
    assert kept and all(replayer.replay(rec, s.index).match for s in kept[:4])
