"""What the recorder keeps between a module's calls to spend less at each (per module, per
parameter) is made again when what it was made of changes: every call's records are what the
module holds at that call."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import recorder
from recorder.store.reader import RunReader
from tests.recorder.readback import raw


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x).sum()


def _replace_weight(net: Net) -> None:
    net.block[0].weight = nn.Parameter(torch.randn(8, 8))  # another tensor at the same place


def _add_parameter(net: Net) -> None:
    net.block[0].register_parameter("extra", nn.Parameter(torch.randn(3)))


def _tie(net: Net) -> None:
    net.block[2].weight = net.block[0].weight  # listed once by named_parameters from now on


def _drop_bias(net: Net) -> None:
    net.block[0].bias = None


def _replace_child(net: Net) -> None:
    net.block[2] = nn.Linear(8, 8)


def _shape_change(net: Net) -> None:
    net.block[0].weight.data = torch.randn(8, 8).t()  # same object, other strides


CHANGES: list[Callable[[Net], None]] = [lambda net: None, _replace_weight, lambda net: None, _add_parameter, _tie,
                                        _drop_bias, _replace_child, _shape_change, lambda net: None]


def test_a_modules_parameter_records_follow_its_parameters_as_they_change(tmp_path: Path) -> None:
    """A recorded module's call records the parameters its module holds at that call, by the names
    ``named_parameters()`` gives then, bit for bit: after a parameter was replaced by another tensor,
    added, tied to another, set to None, after a child was replaced and after a weight's strides
    changed through ``.data``."""
    torch.manual_seed(0)
    net = Net()
    path = tmp_path / "run.zarr"
    expected = []
    with recorder.record(path, model=net, mode="full", modules=["block"]) as run:
        for change in CHANGES:
            change(net)
            expected.append([(name, tuple(p.shape), tuple(p.stride()), raw(p.detach()))
                             for name, p in net.block.named_parameters()])
            net(torch.randn(4, 8, requires_grad=True)).backward()
            run.next_iteration()
    assert run.status == "complete", run.failure
    rank = RunReader(path).rank(0)
    forward = [i for i in range(len(rank)) if int(rank.column("steps/phase")[i]) == 0]
    assert len(forward) == len(CHANGES)
    for step, want in zip(forward, expected, strict=True):
        got = [(r.name, tuple(r.shape), tuple(r.stride), raw(rank.tensor(r)))
               for r in rank.tensor_records(step) if r.role == "param"]
        assert got == want
