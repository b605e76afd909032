"""Recording never perturbs training: the recorder consumes no RNG and changes no setting."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import recorder
from recorder import snapshot
from tests.models import TinyGPT, batch, train_step


def _train(record_kwargs, path, iterations=4):
    torch.manual_seed(123)
    np.random.seed(123)
    random.seed(123)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, draws = [], []

    def loop():
        for i in range(iterations):
            losses.append(train_step(model, opt, i))
            # Code between steps that draws from every generator: any draw by the recorder shows here.
            draws.append((torch.rand(1).item(), np.random.rand(), random.random()))

    if record_kwargs is None:
        loop()
    else:
        with recorder.record(path, model=model, optimizer=opt, **record_kwargs) as run:
            loop()
        assert run.status == "complete" and run.failure is None
    return losses, draws, {n: p.detach().clone() for n, p in model.state_dict().items()}


@pytest.mark.parametrize("kwargs", [{"mode": "full"}, {"mode": "stats"}, {"mode": "full", "every": 2},
                                    {"mode": "flight", "keep": 2}, {"mode": "full", "modules": "**"},
                                    {"mode": "stats", "on_anomaly": "stop"}],
                         ids=["full", "stats", "full-every-2", "flight", "every-module", "on-anomaly-stop"])
def test_training_bitwise_identical_with_recording(tmp_path, kwargs):
    """Losses, final parameters and every RNG draw are bitwise identical with and without recording."""
    base_losses, base_draws, base_params = _train(None, None)
    settings_before = snapshot.settings()
    losses, draws, params = _train(kwargs, tmp_path / "run.zarr")
    assert snapshot.settings() == settings_before
    assert draws == base_draws
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(losses, base_losses))
    assert params.keys() == base_params.keys()
    for name in params:
        assert torch.equal(params[name].view(torch.uint8), base_params[name].view(torch.uint8)), name


def test_global_hooks_removed_after_close(tmp_path):
    """After a recording closes, no module or optimizer hook of the recorder remains."""
    from torch.nn.modules import module as module_mod

    before = (len(module_mod._global_forward_pre_hooks), len(module_mod._global_forward_hooks))
    model = TinyGPT()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with recorder.record(tmp_path / "run.zarr", model=model, optimizer=opt):
        model(batch(0)[0]).sum().backward()
    assert (len(module_mod._global_forward_pre_hooks), len(module_mod._global_forward_hooks)) == before
    assert not opt._optimizer_step_post_hooks
    assert all(not p._backward_hooks for p in model.parameters())


def test_zero_edit_hooks_and_signal_handlers_removed_after_close(tmp_path):
    """modules=, optimizer="auto" and flight mode leave no global module or optimizer hook and no
    signal handler of theirs behind."""
    import signal

    from torch.nn.modules import module as module_mod
    from torch.optim import optimizer as optimizer_mod

    before = (len(module_mod._global_forward_pre_hooks), len(module_mod._global_forward_hooks),
              len(optimizer_mod._global_optimizer_post_hooks), signal.getsignal(signal.SIGTERM))
    model = TinyGPT()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with recorder.record(tmp_path / "run.zarr", optimizer="auto", mode="flight", modules="**") as run:
        assert signal.getsignal(signal.SIGTERM) != before[3]
        train_step(model, opt, 0)
    assert run.iteration == 1
    assert (len(module_mod._global_forward_pre_hooks), len(module_mod._global_forward_hooks),
            len(optimizer_mod._global_optimizer_post_hooks), signal.getsignal(signal.SIGTERM)) == before
