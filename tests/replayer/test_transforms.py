"""Paper steps called under torch.func transforms (vmap, grad, jvp; per-sample gradients): recorded
with the values the transform holds (a vmap's whole batch, with its batch dimensions), NaN found in
them, recording going on afterwards, and a vmapped step replayed under vmap again, bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call, grad, jvp, vmap

import recorder
import replayer
from recorder import transforms
from recorder.errors import ReplayError
from tests.cli import ROOT, pdbg


@recorder.paper_step("Eq. 5", description="softmax of a row, and its norm")
def row_softmax(x: torch.Tensor, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.softmax(x / temperature, dim=-1), x.norm()


@recorder.paper_step("Eq. 6", description="projection, then Eq. 5")
class Projection(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return row_softmax(self.fc(x))[0]


def bits(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().view(-1).view(torch.uint8).numpy())


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    torch.manual_seed(0)
    layer = Projection()
    x = torch.randn(3, 5, 4)
    path = tmp_path_factory.mktemp("func") / "run.zarr"
    with recorder.record(path, mode="full") as run:
        vmap(row_softmax, in_dims=1)(x)                                         # 0
        vmap(layer)(x)                                                          # 1, 2 (Eq. 5 inside)
        grad(lambda t: row_softmax(t)[1])(x[0])                                 # 3
        jvp(lambda t: row_softmax(t)[0], (x[0],), (torch.ones(5, 4),))          # 4
        params = dict(layer.named_parameters())
        vmap(grad(lambda p, xi: functional_call(layer, p, (xi,)).sum()), in_dims=(None, 0))(params, x[0])  # 5, 6
        vmap(vmap(row_softmax))(x[0:2])                                         # 7
        row_softmax(x[0])                                                       # 8: plain, after them all
        vmap(row_softmax, in_dims=(0, None))(x[:2], 0.0)                        # 9: x / 0, born inside
    assert run.status == "complete" and run.failure is None
    return replayer.open(path), x, layer


def test_steps_under_transforms_hold_the_values_the_transform_holds(recorded):
    rec, x, layer = recorded
    steps = list(rec.steps)
    assert [(s.name, s.phase) for s in steps] == [
        ("row_softmax", "forward"), ("Projection", "forward"), ("row_softmax", "forward"),
        ("row_softmax", "forward"), ("row_softmax", "forward"), ("Projection", "forward"),
        ("row_softmax", "forward"), ("row_softmax", "forward"), ("row_softmax", "forward"),
        ("row_softmax", "forward")]
    for s in steps[:8]:
        assert transforms.NOTE in s.extra["notes"]
    assert "notes" not in steps[8].extra
    # vmap over dim 1: the whole batch as called, the batch dims of the arguments and results
    assert steps[0].extra["vmap"] == {"args.0": [1], "output.0": [0], "output.1": [0]}
    assert bits(steps[0].tensor("args.0")) == bits(x)
    assert bits(steps[0].tensor("output.0")) == bits(torch.softmax(x.movedim(1, 0), dim=-1))
    assert bits(steps[0].tensor("output.1")) == bits(torch.stack([x[:, i].norm() for i in range(5)]))
    # grad and jvp: the plain values
    assert "vmap" not in steps[3].extra and bits(steps[3].tensor("args.0")) == bits(x[0])
    assert bits(steps[4].tensor("output.0")) == bits(torch.softmax(x[0], dim=-1))
    # per-sample gradients: parameters unbatched, the input batched
    assert steps[6].extra["vmap"] == {"args.0": [0], "output.0": [0], "output.1": [0]}
    assert bits(steps[5].tensor("fc.weight")) == bits(layer.fc.weight.detach())
    assert steps[7].extra["vmap"]["args.0"] == [0, 0]
    assert bits(steps[8].tensor("output.0")) == bits(torch.softmax(x[0], dim=-1))


def test_nan_born_inside_vmap_is_found(recorded):
    rec, _, _ = recorded
    assert [s.status for s in rec.steps] == ["ok"] * 9 + ["nonfinite"]
    assert replayer.first_nonfinite(rec).step.index == 9


def test_a_vmapped_step_replays_under_vmap_bit_for_bit(recorded):
    rec, _, _ = recorded
    for index in (0, 1, 2, 3, 4, 5, 6, 8, 9):
        result = replayer.replay(rec, index)
        assert result.match, (index, result.outputs)
    with pytest.raises(ReplayError, match="nested torch.func.vmap"):
        replayer.replay(rec, 7)


def test_replaying_a_step_of_nested_vmap_is_one_line_from_the_cli(recorded):
    rec, _, _ = recorded
    done = pdbg("replay", str(rec.path), "7", cwd=ROOT)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "nested torch.func.vmap" in done.stderr
