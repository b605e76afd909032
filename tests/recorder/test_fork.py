"""A forked child of a recording process (a DataLoader worker, a forked evaluation) does not record:
the recording, its writer thread, its store and its flight ring are the parent's. Steps called in the
child are plain calls, and a SIGTERM to the child (a job's shutdown reaches the workers too) neither
writes to the parent's store nor waits for a writer the child does not have."""

from __future__ import annotations

import textwrap

import torch
from torch.utils.data import DataLoader, Dataset

import recorder
import replayer
from recorder import capture
from tests.cli import ROOT, python


@recorder.paper_step("Eq. 4", description="augmentation: scale and shift")
def augment(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


class Augmented(Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> tuple[torch.Tensor, bool]:
        return augment(torch.full((8,), float(i))), capture.ACTIVE is None


def test_steps_called_in_dataloader_workers_are_plain_calls(run_path):
    """Workers forked while recording call the step as a plain function (the worker has no active
    recording); the recording holds the training process's steps only, and completes."""
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(Augmented(), batch_size=4, num_workers=2, multiprocessing_context="fork")
    with recorder.record(run_path, model=model, optimizer=opt, mode="full") as run:
        seen = []
        for x, unrecorded in loader:
            seen += unrecorded.tolist()
            model(augment(x)).sum().backward()
            opt.step()
            opt.zero_grad()
    assert seen == [True] * 16
    assert run.status == "complete" and run.failure is None
    rec = replayer.open(run_path)
    assert [(s.name, s.phase, s.iteration) for s in rec.steps] == [("augment", "forward", i) for i in range(4)]
    augmented_in_worker = (torch.arange(8, 12.) * 2 + 1).repeat_interleave(8).view(4, 8)
    assert torch.equal(rec.steps[2].tensor("args.0"), augmented_in_worker)


SIGTERM_IN_CHILD = textwrap.dedent("""
    import os, signal, sys, torch, recorder, replayer
    torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, lambda *a: print("handled", flush=True))  # the program's own shutdown
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
    recorder.annotate(model[0], "Eq. 1")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with recorder.record(sys.argv[1], model=model, optimizer=opt, mode="flight", keep=2) as run:
        for i in range(8):
            model(torch.randn(4, 16)).sum().backward(); opt.step(); opt.zero_grad()
            if i == 3:
                pid = os.fork()
                if pid == 0:
                    model(torch.randn(4, 16))
                    os.kill(os.getpid(), signal.SIGTERM)
                    print("child", run.session.dumps, run.flush(), flush=True)
                    run.close()
                    os._exit(0)
                print("child exit", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
    rec = replayer.open(sys.argv[1])
    print(rec.status, len(rec.steps), [d["reason"] for d in run.session.dumps])
""")


def test_a_forked_child_leaves_the_recording_to_its_parent(tmp_path):
    """In the child, SIGTERM goes straight to the program's handler (no ring written, no flush
    waiting for a writer), and closing the child's copy writes nothing; the parent's recording goes
    on and completes with every step."""
    script = tmp_path / "fork_child.py"
    script.write_text(SIGTERM_IN_CHILD)
    done = python(str(script), str(tmp_path / "run.zarr"), cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["handled", "child [] False", "child exit 0", "complete 16 ['end']"]


class Corrupt(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 5:
            raise ValueError(f"corrupt sample {i}")
        return torch.full((8,), float(i))


def test_a_worker_error_that_ends_the_run_is_named_by_ended_by(run_path):
    """A DataLoader worker's exception reaches training re-raised by torch, whose message's first line says
    only where it was caught: `pdbg info` said "ended by: ValueError: Caught ValueError in DataLoader worker
    process 0." and not which error (the recording holds the whole message)."""
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(Corrupt(), batch_size=2, num_workers=1, multiprocessing_context="fork")
    try:
        with recorder.record(run_path, model=model, optimizer=opt, mode="full"):
            for x in loader:
                model(augment(x)).sum().backward()
                opt.step()
                opt.zero_grad()
    except ValueError:
        pass
    rec = replayer.open(run_path)
    assert rec.status == "crashed" and len(rec.steps) == 2
    assert rec.ended_by == ("ValueError: Caught ValueError in DataLoader worker process 0. "
                            "(ValueError: corrupt sample 5)")
