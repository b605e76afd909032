"""Runs of several processes (torch.distributed, gloo on CPU, 2 ranks): each rank records its own
group of one run; info and bisect cover every rank and name the origin's; a step of rank k that
all-reduces replays alone in this process from the recorded results; the SIGKILL of one rank
leaves the other's recording and its own committed prefix intact."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import replayer
from recorder.errors import FormatError, NotARecordingError, ReplayError
from recorder.store import layout
from tests.cli import ROOT
from tests.cli import pdbg_here as _pdbg

SCRIPT = Path(__file__).with_name("dist_train.py")
pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="this torch build has no gloo backend")


def pdbg(*args: str, code: int = 0) -> subprocess.CompletedProcess[str]:
    res = _pdbg(*args, cwd=ROOT)
    assert res.returncode == code, (args, res.stdout, res.stderr)
    return res


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(out: Path, *, cli: bool, **knobs: object) -> list[subprocess.CompletedProcess[str]]:
    """Start both ranks as torchrun would (its environment), wait for both."""
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PYTHONPATH": str(ROOT),
               "GLOO_SOCKET_IFNAME": "lo",  # loopback: no network, and no need for the host name to resolve
               **{k: str(v) for k, v in knobs.items()}}
        command = [sys.executable, "-m", "tui.cli", "record", "-o", str(out), "--", str(SCRIPT)] if cli else \
            [sys.executable, str(SCRIPT)]
        if not cli:
            env["RECORD_TO"] = str(out)
        procs.append(subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    done = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=240)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return done


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`pdbg record` under torchrun's environment; rank 1 divides by zero at iteration 3."""
    out = tmp_path_factory.mktemp("dist") / "run.zarr"
    for rank, res in enumerate(launch(out, cli=True, NAN_RANK=1, NAN_AT=3)):
        assert res.returncode == 0, res.stderr
        assert f"pdbg: rank {rank} of 2: recording in {out} (complete, 24 steps)" in res.stderr  # whose line it is
    return out


def test_each_rank_records_its_own_group(nan_run: Path) -> None:
    assert (nan_run / layout.MANIFEST_KEY).is_file() and (nan_run / "rank1" / layout.MANIFEST_KEY).is_file()
    rec = replayer.open(nan_run)
    assert rec.ranks == [0, 1] and rec.status == "complete"
    for rank in (0, 1):
        r = rec.of_rank(rank)
        assert r.rank.dist == {"rank": rank, "world_size": 2, "backend": "gloo"}
        assert r.rank.status == "complete" and r.run_info["pid"] != rec.of_rank(1 - rank).run_info["pid"]
        table = r.steps
        # Per iteration: sharpen and global_mean forward, then their backward steps.
        assert len(table) == 6 * 4
        assert sorted(set(table.column("iteration").tolist())) == list(range(6))
        means = [s for s in table if s.name == "global_mean" and s.phase == "forward"]
        assert len(means) == 6
        for s in means:
            calls = s.extra["collectives"]
            assert [c["op"] for c in calls] == ["all_reduce", "all_reduce"]
            assert [c["async_op"] for c in calls] == [False, True]
            assert [x.name for x in s.records if x.role == "collective"] == ["all_reduce.0", "all_reduce.1"]
            count = s.tensor("all_reduce.1", role="collective")
            assert torch.equal(count, torch.tensor([32.0]))  # 16 rows on each of the 2 ranks
        # The parameters' broadcast ran outside every step: nothing recorded for it.
        assert not any(c["op"] == "broadcast" for s in table for c in s.extra.get("collectives", []))


def test_bisect_names_the_rank_of_the_origin(nan_run: Path) -> None:
    origin = replayer.first_nonfinite(replayer.open(nan_run), all_ranks=True)
    assert origin.rank == 1 and origin.step is not None
    assert (origin.step.name, origin.step.phase, origin.step.iteration) == ("sharpen", "forward", 3)
    other = origin.others[0]
    assert other.step is None and other.entered is not None  # rank 0 only received it
    assert (other.entered.name, other.entered.iteration) == ("global_mean", 3)
    assert "collective all_reduce.0" in other.cause and "other rank" in other.cause
    # Rank 0 alone cannot see where it came from; the CLI looks at every rank by default.
    assert replayer.first_nonfinite(replayer.open(nan_run)).step is None
    res = pdbg("bisect", str(nan_run), "--json", code=1)
    doc = json.loads(res.stdout)
    assert doc["rank"] == 1 and doc["origin"]["name"] == "sharpen" and doc["origin"]["rank"] == 1
    assert doc["other_ranks"]["0"]["entered"]["name"] == "global_mean"
    text = pdbg("bisect", str(nan_run), code=1).stdout
    assert text.startswith("origin: rank 1 · ") and "rank 0: first non-finite at step" in text
    text = pdbg("info", str(nan_run)).stdout
    assert "NaN origin: rank 1 · step " in text and "  rank 1: complete, 24 steps, 6 iterations, backend gloo" in text
    info = json.loads(pdbg("info", str(nan_run), "--json").stdout)
    assert info["ranks"] == 2 and info["first_nonfinite"]["rank"] == 1
    assert [(r["rank"], r["status"], r["backend"], r["steps"]) for r in info["rank_details"]] == [
        (0, "complete", "gloo", 24), (1, "complete", "gloo", 24)]


def test_a_nan_a_step_makes_before_its_own_all_reduce_is_its_rank_s(tmp_path: Path) -> None:
    """Rank 1's global_mean divides its sum by zero, then all-reduces it: both ranks' all_reduce
    returns Inf. Each rank was sent to the other ("returned non-finite values from the other rank"),
    and the origin named was rank 0's; what each rank sent into its collectives tells them apart."""
    out = tmp_path / "run.zarr"
    for res in launch(out, cli=False, BLOW_RANK=1, BLOW_AT=2):
        assert res.returncode == 0, res.stderr
    origin = replayer.first_nonfinite(replayer.open(out), all_ranks=True, ops=True)
    assert origin.rank == 1 and origin.step is not None, origin.cause
    assert (origin.step.name, origin.step.iteration) == ("global_mean", 2)
    assert origin.cause.endswith("from finite inputs, and sent them to the other ranks through its all_reduce.0")
    assert origin.op is not None and origin.op.name == "aten::div" and "/ scale" in origin.op.code
    other = origin.others[0].cause
    assert "returned non-finite values that this rank (0 of 2) did not send: they came from the other rank" in other
    # Rank 0's own operation finder does not name the replay's copy of the recorded result.
    alone = replayer.first_nonfinite(replayer.open(out), ops=True)
    assert alone.op is None or "all_reduce" not in (alone.op.code or ""), alone.op


def test_a_nan_that_entered_a_rank_before_its_all_reduce_is_that_rank_s(tmp_path: Path) -> None:
    """Code outside every step puts a NaN into rank 1's input to global_mean, which all-reduces it.
    Rank 1 was told the NaN "came from the other rank; look for the origin there", where there was
    none: its own input is named, and what it sent."""
    out = tmp_path / "run.zarr"
    for res in launch(out, cli=False, POISON_RANK=1, POISON_AT=2):
        assert res.returncode == 0, res.stderr
    origin = replayer.first_nonfinite(replayer.open(out), all_ranks=True)
    assert origin.rank == 1 and origin.step is None and origin.entered is not None, origin.cause
    assert (origin.entered.name, origin.entered.iteration) == ("global_mean", 2)
    alone = replayer.first_nonfinite(replayer.open(out, 1))
    assert origin.cause == f"rank 1: {alone.cause}"
    assert alone.cause.startswith("input args.0 of step ") and "came non-finite (1 NaN of 256) from code outside " \
        "every recorded step" in alone.cause and alone.cause.endswith("; this rank sent them to the others through its "
                                                       "all_reduce.0"), alone.cause
    received = replayer.first_nonfinite(replayer.open(out, 0)).cause
    assert "did not send: they came from the other rank" in received, received


def test_the_tui_of_one_rank_names_the_rank_of_the_origin(nan_run: Path) -> None:
    """The TUI shows rank 0: `g`, `b` and `a` name the origin on rank 1 and how to open it (they said
    no NaN was recorded), and the cursor stays where it was."""
    from tests.tui.test_app import run
    from tui import views

    async def body(app, pilot) -> None:  # type: ignore[no-untyped-def]
        for key in ("g", "b"):
            await pilot.press(key)
            await app.workers.wait_for_complete()
            await pilot.pause()
            text = str(app.panel_text)
            assert text.startswith("rank 1: step ") and "sharpen" in text, (key, text)
            assert f"open rank 1 with: pdbg {nan_run} --rank 1" in text  # (no quoting needed for this path)
            assert app.timeline.step_index == 0
        await pilot.press("a")
        await pilot.pause()
        page = str(app.screen.query_one("#page").render())
        assert "rank 1: step " in page and "(open rank 1 with --rank 1)" in page
        # rank 0's own line is where the NaN came in through its collective, not a second origin
        rows = [(row.kind, row.text) for row in views.alerts(app.rec)]
        assert [kind for kind, _ in rows[:2]] == ["origin", "entered"], rows

    run(body, nan_run)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_step_that_all_reduces_replays_alone_from_the_recording(nan_run: Path, rank: int) -> None:
    """No process group here: each collective gets the recorded results, bit for bit."""
    assert not torch.distributed.is_initialized()
    rec = replayer.open(nan_run, rank)
    for which in ("global_mean@iter=1", "global_mean@iter=3", "global_mean@iter=1:backward", "sharpen@iter=3"):
        result = replayer.replay(rec, which)
        assert result.match, (which, [d.to_json() for d in result.outputs], result.warnings)
        assert not result.warnings, result.warnings
    assert not torch.distributed.is_initialized()  # nothing of the replay's stand-ins is left behind
    assert torch.distributed.all_reduce.__module__ == "torch.distributed.distributed_c10d"
    res = pdbg("replay", str(nan_run), "global_mean@iter=2", "--rank", str(rank), "--json")
    assert json.loads(res.stdout)["match"] is True


def test_a_bundle_of_a_rank_step_replays_elsewhere(nan_run: Path, tmp_path: Path) -> None:
    rec = replayer.open(nan_run, 1)
    replayer.bundle(rec, rec.step("global_mean@iter=3"), tmp_path / "failure.pdbg", verify=True)
    shared = replayer.open(tmp_path / "failure.pdbg")
    assert shared.rank.dist == {"rank": 1, "world_size": 2, "backend": "gloo"}
    assert replayer.replay(shared).match
    assert ", rank 1 of 2), made " in pdbg("info", str(tmp_path / "failure.pdbg")).stdout  # whose step it is


def test_a_replay_that_communicates_differently_is_refused(nan_run: Path) -> None:
    rec = replayer.open(nan_run, 0)
    with pytest.raises(ReplayError, match=r"the replay called all_reduce after the 2 collective\(s\) the recording "
                                          r"holds for this step"):
        replayer.replay(rec, "global_mean@iter=1", swap={"global_mean": f"{__name__}:three_collectives"})
    with pytest.raises(ReplayError, match=r"the replay's all_reduce.1 is torch.float32 \(1, 16\), the recording's "
                                          r"float32 \(1,\)"):
        replayer.replay(rec, "global_mean@iter=1", swap={"global_mean": f"{__name__}:reduce_twice"})
    assert not torch.distributed.is_initialized()


def three_collectives(h: torch.Tensor, coupled: bool, scale: float = 1.0, backward_sync: bool = False) -> torch.Tensor:
    total, count = h.sum(0, keepdim=True), torch.tensor([float(h.shape[0])])
    for t in (total, count, count):
        torch.distributed.all_reduce(t)
    return total / count


def reduce_twice(h: torch.Tensor, coupled: bool, scale: float = 1.0, backward_sync: bool = False) -> torch.Tensor:
    total = h.sum(0, keepdim=True)
    torch.distributed.all_reduce(total)
    torch.distributed.all_reduce(total)
    return total


def test_a_rank_that_recorded_to_its_own_path_is_named(nan_run: Path, tmp_path: Path) -> None:
    """Rank 1 recording to a path of its own (each rank given its own directory): that directory holds
    only rank 1's group; it was "not a PaperDebugger recording", with nothing about ranks."""
    import shutil

    alone = tmp_path / "rank1_only.zarr"
    shutil.copytree(nan_run / "rank1", alone / "rank1")
    res = pdbg("info", str(alone), code=2)
    assert res.stderr.strip().splitlines() == [
        f"pdbg: error: {alone} holds only rank 1's part of a run of several processes: rank 0 recorded to another "
        "path, and every rank must record to the same one; move rank1/ into the recording rank 0 made, and open that"]


def test_a_rank_s_group_given_as_a_recording_names_the_recording_and_the_rank(nan_run: Path) -> None:
    """`pdbg bisect run.zarr/rank1` (rank 1's recording, as a user looking at the directory takes it) said it "is
    not a PaperDebugger recording": it names the recording the group belongs to and --rank 1."""
    for rank in (1, 0):
        group = nan_run / f"rank{rank}"
        res = pdbg("bisect", str(group), code=2)
        assert res.stderr.strip().splitlines() == [
            f"pdbg: error: {group} is rank {rank}'s part of the recording {nan_run}, not a recording of its own: give "
            f"{nan_run} with --rank {rank} (replayer.open({str(nan_run)!r}, rank={rank}) in Python)"], res.stderr
    with pytest.raises(NotARecordingError, match=r"is rank 1's part of the recording"):
        replayer.open(nan_run / "rank1")


def test_a_backward_that_communicates_is_refused_in_one_line(tmp_path: Path) -> None:
    """Collectives called during a backward pass are not recorded: the replay of such a backward step
    said "Default process group has not been initialized", in torch's words."""
    out = tmp_path / "run.zarr"
    for res in launch(out, cli=False, BACKWARD_SYNC=1, ITERATIONS=2):
        assert res.returncode == 0, res.stderr
    rec = replayer.open(out, 1)
    assert replayer.replay(rec, "global_mean@iter=1").match  # its forward replays
    refusal = (r"backward step global_mean@iter=1#0:backward calls torch.distributed's all_reduce \(as "
               r"SyncBatchNorm's backward does\): collectives called during a backward pass are not recorded")
    with pytest.raises(ReplayError, match=refusal):
        replayer.replay(rec, "global_mean@iter=1:backward")
    # A bundle of it says the same (it named the step by its index in the bundle, not in the run)
    shared = replayer.bundle(rec, "global_mean@iter=1:backward", tmp_path / "backward.pdbg")
    with pytest.raises(ReplayError, match=refusal):
        replayer.replay(replayer.open(shared.path), shared.main_step)


def test_an_edit_of_a_step_that_communicates_says_what_it_cannot_change(nan_run: Path) -> None:
    rec = replayer.open(nan_run, 0)
    res = replayer.replay(rec, "global_mean@iter=1", edit={"args.0": "x * 2"})
    assert "the 2 collectives called during the replay returned their recorded results: the intervention changes " \
           "what this rank computes, not what the other ranks sent it" in res.warnings
    assert replayer.replay(rec, "global_mean@iter=1").warnings == []


def test_unknown_rank_is_a_one_line_error(nan_run: Path) -> None:
    with pytest.raises(FormatError, match=r"has no rank 5; it has ranks 0, 1"):
        replayer.open(nan_run, 5)
    res = pdbg("replay", str(nan_run), "0", "--rank", "7", code=2)
    assert "has no rank 7" in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_sigkill_of_one_rank_leaves_both_recordings_intact(tmp_path: Path) -> None:
    """Rank 1 commits, then is killed at the start of iteration 4; rank 0 trains on to the end."""
    out = tmp_path / "run.zarr"
    first, second = launch(out, cli=False, KILL_RANK=1, KILL_AT=4, COUPLED=3)
    assert first.returncode == 0, first.stderr
    assert second.returncode == -signal.SIGKILL
    rec = replayer.open(out)
    assert rec.ranks == [0, 1] and rec.status == "crashed"
    assert rec.reader.rank_status(0) == "complete" and rec.reader.rank_status(1) == "crashed"
    lengths = {0: 6 * 4, 1: 4 * 4}  # rank 1: every step of iterations 0-3, committed before it died
    for rank, n in lengths.items():
        r = rec.of_rank(rank)
        assert len(r) == n
        assert sorted(set(r.steps.column("iteration").tolist())) == list(range(n // 4))
        for step in r.steps:
            for record in step.records:
                value = r.rank.tensor(record) if record.has_payload else None
                if value is not None and value.is_floating_point() and record.stats["nan"] == 0:
                    assert np.isclose(float(value.double().abs().max()), record.stats["absmax"])
    res = pdbg("info", str(out), "--json")
    assert [(r["rank"], r["status"], r["steps"]) for r in json.loads(res.stdout)["rank_details"]] == [
        (0, "complete", 24), (1, "crashed", 16)]


def test_ranks_from_the_launcher_environment_share_one_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun sets RANK and WORLD_SIZE before the script runs: each rank claims only its own group,
    in either order, and a second recording of the same rank is refused before anything is written."""
    import recorder
    from recorder.errors import RecordingError
    from tests.models import scaled_tanh

    out = tmp_path / "run.zarr"
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with recorder.record(tmp_path / "alone.zarr"):  # rank 1 of this run never starts
        scaled_tanh(torch.ones(3))
    alone = replayer.open(tmp_path / "alone.zarr")
    assert alone.ranks == [0] and alone.reader.missing_ranks == [1] and alone.status == "crashed"
    assert alone.reader.rank_status(1) == "missing" and alone.rank.status == "complete"
    with pytest.raises(FormatError, match="has no rank 1 \\(it never committed a step"):
        replayer.open(tmp_path / "alone.zarr", 1)
    for rank in (1, 0):
        monkeypatch.setenv("RANK", str(rank))
        with recorder.record(out):
            scaled_tanh(torch.ones(3) * (rank + 1))
    before = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    for rank in (1, 0):
        monkeypatch.setenv("RANK", str(rank))
        with pytest.raises(RecordingError, match=f"already holds a recording of rank {rank}"):
            recorder.record(out)
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == before
    rec = replayer.open(out)
    assert rec.ranks == [0, 1] and rec.reader.world_size == 2 and rec.status == "complete"
    for rank in (0, 1):
        step = rec.of_rank(rank).step(0)
        assert torch.equal(step.tensor("args.0"), torch.ones(3) * (rank + 1))
        assert rec.of_rank(rank).rank.dist == {"rank": rank, "world_size": 2, "backend": None}


def test_the_tui_opens_a_rank_and_says_which(nan_run: Path, tmp_path: Path) -> None:
    """`pdbg tui RUN --rank 1`: the header names the rank, the timeline is rank 1's steps, and the
    cursor can go to rank 1's origin (g)."""
    import asyncio

    from tui.app import PdbgApp, open_app

    app = open_app(str(nan_run), None, 1)
    assert isinstance(app, PdbgApp)

    async def main() -> None:
        async with app.run_test(size=(110, 32)) as pilot:
            await pilot.pause()
            assert app.sub_title.endswith(" · rank 1 of 2")
            await pilot.press("g")
            await pilot.pause()
            step = app.step
            assert (step.rec.rank.rank, step.name, step.iteration) == (1, "sharpen", 3)
            app.save_screenshot(str(tmp_path / "rank1.svg"))

    asyncio.run(main())
    assert (tmp_path / "rank1.svg").stat().st_size > 0


def test_a_spawned_process_recording_to_a_taken_path_is_told_about_ranks(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """mp.spawn's workers that start recording before init_process_group all take rank 0: the second
    was told only that the path exists."""
    import multiprocessing

    import recorder
    from recorder.errors import RecordingError

    taken = tmp_path / "run.zarr"
    taken.mkdir()
    (taken / "zarr.json").write_text("{}")
    monkeypatch.setattr(multiprocessing.current_process(), "name", "SpawnProcess-2")
    with pytest.raises(RecordingError, match=r"already exists and is not empty; .* start recording after "
                                             r"init_process_group, so that each knows its rank"):
        recorder.record(taken)


def test_a_ddp_wrapper_step_is_refused_in_one_line(tmp_path: Path) -> None:
    """`--modules '**'` records DistributedDataParallel itself: its replay raised AttributeError
    ('no attribute logger') at every iteration, and verify failed the run."""
    import recorder

    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 4)))
        with recorder.record(tmp_path / "run.zarr", model=model, modules=["**"]) as run:
            model(torch.ones(2, 4)).sum().backward()
            run.next_iteration()
    finally:
        torch.distributed.destroy_process_group()
    rec = replayer.open(tmp_path / "run.zarr")
    with pytest.raises(ReplayError, match="DistributedDataParallel is a wrapper that communicates with the other "
                                          r"ranks .* replay the module it wraps \(the steps at module\)"):
        replayer.replay(rec, "DistributedDataParallel@iter=0")
    res = pdbg("verify", str(tmp_path / "run.zarr"))
    assert "replayed bit for bit (100.0%); 2 steps could not be replayed" in res.stdout, res.stdout


def test_steps_of_a_spawned_process_replay(tmp_path: Path) -> None:
    """torch.multiprocessing.spawn's ranks import the script as __mp_main__: their steps and modules
    could not be found again ('__mp_main__ has no act now'), so no step of such a run replayed."""
    out = tmp_path / "run.zarr"
    res = subprocess.run([sys.executable, str(Path(__file__).with_name("spawn_train.py")), str(out)], check=False,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    rec = replayer.open(out)
    for which in ("Eq. 1@iter=1", "Eq. 1@iter=1:backward", "Block@iter=0", "Block@iter=1:backward"):
        result = replayer.replay(rec, which)
        assert result.match, (which, [d.to_json() for d in result.outputs], result.warnings)
    assert "8 of 8 steps replayed bit for bit" in pdbg("verify", str(out)).stdout


def test_a_nan_that_ddp_s_gradient_all_reduce_brought_says_so(tmp_path: Path) -> None:
    """Under DistributedDataParallel, rank 1's NaN reaches rank 0 through the gradients it all-reduces
    outside every step: rank 0's cause blamed only its optimizer or code outside the steps."""
    out = tmp_path / "run.zarr"
    for res in launch(out, cli=False, NAN_RANK=1, NAN_AT=1, COUPLED=0, DDP=1, ITERATIONS=3):
        assert res.returncode == 0, res.stderr
    lines = pdbg("bisect", str(out), code=1).stdout.splitlines()
    assert lines[0].startswith("origin: rank 1 · "), lines
    rank0 = next(line for line in lines if line.startswith("rank 0: first non-finite"))
    assert "(iteration 2)" in rank0 and "rank 1's came first (iteration 1), and ranks also exchange tensors outside " \
        "every recorded step (DistributedDataParallel's all-reduce of the gradients in backward" in rank0, lines


def test_info_says_what_ended_each_rank(tmp_path: Path) -> None:
    """Rank 1 raises at iteration 2 while rank 0 trains on: info said the run crashed, but only rank 0's
    (none) ended-by line, so nothing told why."""
    out = tmp_path / "run.zarr"
    first, second = launch(out, cli=False, RAISE_RANK=1, RAISE_AT=2, COUPLED=0, ITERATIONS=3)
    assert first.returncode == 0 and second.returncode == 1, (first.stderr, second.stderr)
    text = pdbg("info", str(out)).stdout
    assert "  rank 1: crashed, 8 steps, 2 iterations, backend gloo" in text, text
    assert "    ended by: RuntimeError: rank 1 gave up at iteration 2\n" in text, text
    details = json.loads(pdbg("info", str(out), "--json").stdout)["rank_details"]
    assert [(r["status"], r["ended_by"]) for r in details] == [
        ("complete", None), ("crashed", "RuntimeError: rank 1 gave up at iteration 2")]


def test_verify_of_a_run_of_several_ranks_says_which_it_replayed(nan_run: Path) -> None:
    """`pdbg verify RUN` replays rank 0 alone, and said "N of N steps replayed" as if of the whole run."""
    assert pdbg("verify", str(nan_run), "--sample", "2").stdout.startswith(
        f"{nan_run} (rank 0 of 2; --rank K for another): 2 of 2 steps replayed bit for bit")
    res = pdbg("verify", str(nan_run), "--sample", "2", "--rank", "1", "--json")
    assert json.loads(res.stdout)["rank"] == 1
