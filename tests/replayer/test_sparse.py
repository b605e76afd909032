"""Sparse gradients (nn.Embedding(sparse=True)) are recorded as statistics of the values they store:
a NaN in one is found; a backward replay compares the dense gradients and says which it could not."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import recorder
import replayer
from recorder.errors import ReplayError


@recorder.paper_step("Eq. 8", description="embed tokens, then project")
class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(10, 4, sparse=True)
        self.proj = nn.Linear(4, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.proj(self.table(tokens))


def test_sparse_gradients_have_statistics_and_dense_ones_replay(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Embed()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.tensor([[1, 2, 2, 7]])
    with recorder.record(tmp_path / "run.zarr", model=model, optimizer=opt, mode="full") as run:
        for _ in range(2):
            model(tokens).sum().backward()
            opt.step()
            opt.zero_grad()
    assert run.status == "complete"
    rec = replayer.open(tmp_path / "run.zarr")
    backward = rec.steps.filter(phase="backward")[0]
    table = next(r for r in backward.records if r.name == "table.weight")
    assert table.role == "param_grad" and not table.has_payload
    # the rows it stores: token 2's summed over its two places, tokens 1 and 7
    rows = backward.tensor("output")[0] @ rec.step(backward.forward).tensor("proj.weight")
    stored = torch.stack([rows[0], rows[1] + rows[2], rows[3]])
    assert (table.stats["min"], table.stats["max"], table.stats["nan"]) == (stored.min().item(),
                                                                           stored.max().item(), 0)
    result = replayer.replay(rec, backward.index)
    assert result.match
    assert {d.name for d in result.outputs} == {"proj.weight", "proj.bias"}
    assert any(w.startswith("not compared: param_grad table.weight (torch.sparse_coo tensor") for w in result.warnings)


def test_an_inf_born_in_a_sparse_gradient_is_found(tmp_path: Path) -> None:
    table = nn.Embedding(10, 4, sparse=True)
    opt = torch.optim.SGD(table.parameters(), lr=0.0)
    tokens = torch.tensor([2, 5, 2])
    with recorder.record(tmp_path / "run.zarr", model=table, optimizer=opt, mode="full", modules=["**"]):
        for scale in (1.0, 1.0, 3e38):  # token 2's two rows of 3e38 sum to inf, from finite grad outputs
            (table(tokens) * scale).sum().backward()
            opt.step()
            opt.zero_grad()
    rec = replayer.open(tmp_path / "run.zarr")
    backward = rec.steps.filter(phase="backward")
    assert [s.status for s in backward] == ["ok", "ok", "nonfinite"]
    origin = replayer.first_nonfinite(rec)
    assert origin.step is not None and origin.step.index == backward[2].index
    assert "param_grad weight" in origin.cause and "Inf" in origin.cause


def test_a_backward_step_with_only_a_sparse_gradient_is_refused_in_one_line(tmp_path: Path) -> None:
    table = nn.Embedding(10, 4, sparse=True)
    with recorder.record(tmp_path / "run.zarr", model=table, mode="full", modules=["**"]):
        table(torch.tensor([1, 2])).sum().backward()
    rec = replayer.open(tmp_path / "run.zarr")
    with pytest.raises(ReplayError, match="has nothing a replay could compare: param_grad weight"):
        replayer.replay(rec, rec.steps.filter(phase="backward")[0].index)
