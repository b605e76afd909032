"""CUDA: a small model with dropout recorded on the GPU replays bit for bit, in this process and in a
fresh one, and every device's CUDA generator state is the caller's again afterwards.

Runs only where a CUDA GPU is present; elsewhere every test here is skipped, and says why.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import recorder
import replayer
from tests.cli import pdbg
from tests.models import TinyGPT, batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA GPU here: the CUDA record-and-replay check needs one")


@pytest.fixture(scope="module")
def cuda_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cuda") / "run.zarr"
    torch.manual_seed(0)
    torch.cuda.manual_seed_all(0)
    model = TinyGPT().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with recorder.record(path, model=model, optimizer=opt, mode="full") as run:
        for i in range(2):
            x, y = (t.cuda() for t in batch(i))
            logits = model(x)
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
            opt.step()
            opt.zero_grad()
    assert run.status == "complete" and run.failure is None
    return path


def test_every_step_replays_bitwise_and_cuda_rng_is_restored(cuda_run: Path) -> None:
    rec = replayer.open(cuda_run)
    assert len(rec) == 24 and rec.run_info["cuda"]
    assert {r.device for r in rec.step(0).records} == {"cuda:0"}
    assert any(part.startswith("cuda:") for part in rec.step(0).rng)
    torch.cuda.manual_seed_all(1234)
    before = [s.clone() for s in torch.cuda.get_rng_state_all()]
    cpu_before = torch.get_rng_state().clone()
    for step in rec.steps:
        res = replayer.replay(rec, step)
        assert res.match, (step, [d.summary() for d in res.outputs if not d.match])
        assert all(v.device.type == "cuda" for v in res.values.values() if v is not None)
    assert all(torch.equal(a, b) for a, b in zip(before, torch.cuda.get_rng_state_all()))
    assert torch.equal(cpu_before, torch.get_rng_state())


def test_verify_in_a_fresh_process(cuda_run: Path, tmp_path: Path) -> None:
    res = pdbg("verify", str(cuda_run), "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert json.loads(res.stdout) == {"replayed": 24, "matched": 24, "mismatches": [], "not_replayed": [],
                                      "environment_differences": []}


def test_a_training_under_cuda_as_the_default_device_keeps_its_payloads(tmp_path: Path) -> None:
    """``torch.set_default_device("cuda")`` (here as a context): the recorder's host staging of
    device payloads is still host memory, so every payload is kept and replays bit for bit."""
    path = tmp_path / "run.zarr"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = TinyGPT()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        with recorder.record(path, model=model, optimizer=opt, mode="full") as run:
            x, y = (t.cuda() for t in batch(0))
            logits = model(x)
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
            opt.step()
    assert run.status == "complete" and run.failure is None
    rec = replayer.open(path)
    assert all(r.has_payload for s in rec.steps for r in s.records)
    assert all(replayer.replay(rec, s).match for s in rec.steps)
