"""Shared fixtures: small models with decorated paper steps and a helper to read a run back."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch


@pytest.fixture(autouse=True)
def _seeded() -> None:
    """Every test starts from the same global RNG states and thread count, and leaves them alone."""
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def run_path(tmp_path):
    return tmp_path / "run.zarr"
