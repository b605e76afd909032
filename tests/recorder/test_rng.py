"""RNG snapshots: a restored snapshot reproduces random draws exactly, and restores the caller's."""

from __future__ import annotations

import random

import numpy as np
import torch

import recorder
from recorder import snapshot
from recorder.store.reader import RunReader
from tests.recorder.readback import rng_parts


@recorder.paper_step("Eq. 9", description="dropout then noise")
def noisy_dropout(x: torch.Tensor) -> torch.Tensor:
    noise = float(np.random.rand()) + random.random()
    return torch.nn.functional.dropout(x, p=0.5, training=True) + noise


def test_restored_snapshot_reproduces_dropout_mask(run_path):
    """Applying a step's recorded RNG snapshot reproduces its dropout mask (and numpy/python draws)."""
    x = torch.randn(64, 64)
    with recorder.record(run_path, mode="full"):
        for _ in range(3):  # three calls, three different masks
            noisy_dropout(x)
    rank = RunReader(run_path).rank(0)
    outputs = []
    for step in range(3):
        recorded = rank.tensor(next(r for r in rank.tensor_records(step) if r.role == "output"))
        with snapshot.applied_rng(rng_parts(rank, step)):
            replayed = noisy_dropout(x)
        assert torch.equal(replayed.view(torch.int32), recorded.view(torch.int32))
        outputs.append(recorded)
    assert not torch.equal(outputs[0], outputs[1])


def test_applied_rng_restores_caller_state():
    """After applied_rng, the caller's torch, numpy and python generators continue where they were."""
    parts = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    torch.rand(5), np.random.rand(5), random.random()  # move every generator on
    expected_state = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    with snapshot.applied_rng(parts):
        torch.rand(100), np.random.rand(100), random.random()
    assert torch.equal(torch.get_rng_state(), expected_state[0])
    assert np.array_equal(np.random.get_state()[1], expected_state[1])
    assert random.getstate() == expected_state[2]


def test_rng_parts_round_trip_through_json():
    """Every generator state survives encode/decode exactly."""
    torch.rand(3), np.random.rand(3), random.random(), np.random.randn()  # has_gauss set
    parts = snapshot.rng_parts()
    for name, (_, state) in parts.items():
        back = snapshot.decode_rng_part(name, snapshot.encode_rng_part(name, state))
        if name == "torch":
            assert torch.equal(back, state)
        elif name == "numpy":
            assert back[0] == state[0] and np.array_equal(back[1], state[1]) and back[2:] == state[2:]
        else:
            assert back == state
