"""Recordings and the threads of the training process: one recording at a time however the threads start
theirs, and a training thread that outlives the main thread recorded to its end."""

from __future__ import annotations

import textwrap
import threading
from pathlib import Path

import torch

import recorder
import replayer
from recorder.errors import AlreadyRecording
from recorder.store import backend
from tests.cli import pdbg, python


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, iterations: int) -> None:
    for _ in range(iterations):
        model(torch.randn(4, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def test_two_threads_starting_recordings_at_once_record_one(tmp_path: Path, monkeypatch) -> None:
    """Two threads each start a recording of their own model: the second `record()`, made while the first is
    still creating its store, is refused as a later one is (AlreadyRecording, one line), and the first records
    its own steps alone. Before, both passed the check: the first held no step, the second both models'."""
    opened = backend.open_store
    first_in_store, second_done = threading.Event(), threading.Event()
    refused: list[BaseException] = []

    def open_store(path, *args, **kwargs):
        if Path(path).name == "first.zarr":
            first_in_store.set()
            second_done.wait()
        return opened(path, *args, **kwargs)

    def second() -> None:
        first_in_store.wait()
        model = torch.nn.Linear(8, 1)
        try:
            with recorder.record(tmp_path / "second.zarr", model=model):
                _train(model, torch.optim.SGD(model.parameters(), lr=0.1), 2)
        except recorder.RecordingError as exc:
            refused.append(exc)
        finally:
            second_done.set()

    monkeypatch.setattr(backend, "open_store", open_store)
    thread = threading.Thread(target=second)
    thread.start()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with recorder.record(tmp_path / "first.zarr", model=model, optimizer=optimizer, modules=["*"]) as run:
        thread.join()
        _train(model, optimizer, 3)
    assert [type(exc) for exc in refused] == [AlreadyRecording]
    assert "\n" not in str(refused[0]) and "first.zarr" in str(refused[0])
    assert not (tmp_path / "second.zarr").exists()
    assert run.status == "complete"
    rec = replayer.open(tmp_path / "first.zarr")
    assert len(rec.steps) == 12  # 2 modules, forward and backward, 3 iterations
    assert {rec.step(i).module_path for i in range(len(rec.steps))} == {"0", "1"}


# Training on a thread the main thread never joins: it starts when the main thread's code has ended.
_TRAINS_ON_A_THREAD = textwrap.dedent("""
    import threading, torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    {record}
    go = threading.Event()
    def train():
        go.wait()
        for _ in range(5):
            model(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        print(float(model[0].weight.detach().sum()))
    threading.Thread(target=train).start()
    go.set()
""")


def test_a_recording_left_open_waits_for_a_thread_that_outlives_the_main_thread(tmp_path: Path) -> None:
    """`run = recorder.record(...)` with the training on a thread the main thread does not join: the process
    ends when that thread does, and so does the recording, with its every step (it closed when the main
    thread ended: `complete`, none of the thread's steps)."""
    script = tmp_path / "script.py"
    script.write_text(_TRAINS_ON_A_THREAD.format(
        record=f"import recorder; recorder.record({str(tmp_path / 'run.zarr')!r}, optimizer=opt, modules=['*'])"))
    done = python(str(script), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    rec = replayer.open(tmp_path / "run.zarr")
    assert rec.status == "complete"
    assert len(rec.steps) == 30  # 3 modules, forward and backward, 5 iterations
    assert [rec.step(i).iteration for i in range(0, 30, 6)] == [0, 1, 2, 3, 4]


def test_pdbg_record_waits_for_a_thread_that_outlives_the_scripts_main_code(tmp_path: Path) -> None:
    """`pdbg record` of an unmodified script whose training runs on a thread it does not join records the
    thread's every step, and trains as the script alone does (it said "complete, 0 steps; the script called
    no module")."""
    script = tmp_path / "script.py"
    script.write_text(_TRAINS_ON_A_THREAD.format(record=""))
    alone = python(str(script), cwd=tmp_path)
    done = pdbg("record", "-o", str(tmp_path / "run.zarr"), "--modules", "*", "--", str(script), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == alone.stdout.strip()
    assert "(complete, 30 steps)" in done.stdout + done.stderr
    assert len(replayer.open(tmp_path / "run.zarr").steps) == 30


def test_a_process_pool_left_open_does_not_hang_the_end_of_a_recording(tmp_path: Path) -> None:
    """A recording left open waits for the training threads at the end of the process, but not for a process
    pool's manager thread: imported before the recording began, its pool is told to stop by an exit hook that
    runs after the recorder's, and waiting for it hung the process."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(f"""
        import concurrent.futures.process
        import torch, recorder
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        recorder.record({str(tmp_path / 'run.zarr')!r}, optimizer=opt, modules=['**'])
        pool = concurrent.futures.ProcessPoolExecutor(2)
        print(sum(pool.map(abs, [-1, -2, 3])))
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
    """))
    done = python(str(script), cwd=tmp_path)  # (on a hang: its timeout fails the test)
    assert (done.returncode, done.stdout) == (0, "6\n"), done.stderr
    assert replayer.open(tmp_path / "run.zarr").status == "complete"
