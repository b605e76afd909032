"""A step that changes its module's own parameters in place (a frozen weight merged or renormalised in forward,
an aux-loss-free MoE router's load-balancing bias updated under no_grad): recorded as it left them
(``after:<parameter>``), compared by a replay, and the origin of a NaN it writes, as a buffer is."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import recorder
import replayer
from replayer import bisect as bisect_mod
from tests.cli import pdbg

E, D = 4, 6


@recorder.paper_step("Eq. 4", description="router with a load-balancing bias, nudged in place")
class BiasRouter(nn.Module):
    """DeepSeek-V3 style: the bias is moved toward balance after routing. Normalising by the load's std divides
    0 by 0 when the load is perfectly balanced: the bias goes NaN in place, this call's output still finite."""

    def __init__(self, held: str) -> None:
        super().__init__()
        self.w = nn.Linear(D, E, bias=False)
        if held == "buffer":
            self.register_buffer("expert_bias", torch.zeros(E))
        else:
            self.expert_bias = nn.Parameter(torch.zeros(E), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.w(x).sigmoid()
        idx = torch.topk(scores + self.expert_bias, 2, dim=-1).indices
        with torch.no_grad():
            load = F.one_hot(idx, E).sum((0, 1)).float()
            self.expert_bias += 0.01 * (load.mean() - load) / load.std()
        return scores.gather(1, idx), idx


@recorder.paper_step("Eq. 3", description="a base weight rescaled in place after its use")
class Rescaled(nn.Module):
    def __init__(self, trainable: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 6), requires_grad=trainable)
        self.A = nn.Parameter(torch.randn(4, 6) * 0.1)
        self.scale = 0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight) + F.linear(x, self.A)
        with torch.no_grad():
            self.weight.mul_(self.scale)
        return out


def _route(path: Path, held: str) -> replayer.Recording:
    torch.manual_seed(0)
    router = BiasRouter(held)
    opt = torch.optim.SGD(router.w.parameters(), lr=0.1)
    with torch.no_grad():  # token 0 to experts 0 and 1, token 1 to experts 2 and 3: a perfectly balanced load
        router.w.weight.copy_(torch.tensor([[5.0, 0, 0, 0, 0, 0], [4, 0, 0, 0, 0, 0], [0, 5, 0, 0, 0, 0],
                                            [0, 4, 0, 0, 0, 0]]))
    with recorder.record(path, optimizer=opt):
        for _ in range(3):
            router(torch.eye(2, D))[0].sum().backward()
            opt.step()
            opt.zero_grad()
    return replayer.open(path)


def _train(path: Path | None, trainable: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = Rescaled(trainable)
    opt = torch.optim.SGD([model.A], lr=0.1)
    with recorder.record(path, optimizer=opt, mode="full") if path else contextlib.nullcontext():
        for _ in range(3):
            model(torch.randn(3, 6)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.int32)


@pytest.mark.parametrize("held", ["parameter", "buffer"])
def test_a_router_bias_made_nan_in_place_by_its_own_call_is_the_origin(tmp_path: Path, held: str) -> None:
    """The router's call that writes NaN into its own bias is the origin, the bias held as a frozen Parameter as
    it is held as a buffer. For the Parameter, bisect said no step's results held NaN (exit 0): its in-place
    change was not recorded."""
    path = tmp_path / "route.zarr"
    rec = _route(path, held)
    first = rec.step(0)
    origin = replayer.first_nonfinite(rec)
    assert origin.step is not None and origin.step.index == first.index, origin.cause
    written = ("parameter expert_bias in place (4 NaN of 4)" if held == "parameter" else
               "buffer expert_bias in place (4 NaN of 4, as the module's next call, step 2, found it)")
    assert origin.cause == f"{bisect_mod.describe(first)} produced {written} from finite inputs", origin.cause
    res = pdbg("bisect", str(path), cwd=tmp_path)
    assert res.returncode == 1 and origin.cause in res.stdout, res.stdout


@pytest.mark.parametrize("trainable", [False, True])
def test_a_call_that_writes_its_own_parameter_in_place_replays_it(tmp_path: Path, trainable: bool) -> None:
    """A frozen (or trainable) weight rescaled in place by its module's forward is recorded as the call left it
    (after:weight) and compared by a replay: MATCH bit for bit. The optimizer's update of A, outside the call, is
    no change of the call's; training is as unrecorded."""
    path = tmp_path / "run.zarr"
    recorded = _train(path, trainable)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(recorded, _train(None, trainable)))
    rec = replayer.open(path)
    forwards = [s for s in rec.steps if s.phase == "forward"]
    assert len(forwards) == 3
    for step in forwards:
        assert {r.name for r in step.records if r.role == "output"} == {"output", "after:weight"}
        result = replayer.replay(rec, step.index)
        assert result.match and {d.name for d in result.outputs} == {"output", "after:weight"}, \
            [d.summary() for d in result.outputs]


def test_a_replay_that_writes_the_parameter_otherwise_is_a_mismatch(tmp_path: Path) -> None:
    """A replay whose call changes the parameter in place otherwise than the recorded call did (here: doubles
    it, where the recording halved it) is a MISMATCH on after:weight, its output the same. It was a MATCH."""
    path = tmp_path / "run.zarr"
    _train(path, False)
    rec = replayer.open(path)

    def doubling(m: nn.Module) -> nn.Module:
        m.scale = 2.0
        return m

    result = replayer.replay(rec, 0, swap={".": doubling})
    assert not result.match and result.diffs["output"].match and not result.diffs["after:weight"].match


def test_a_step_that_writes_no_parameter_records_no_change(tmp_path: Path) -> None:
    """A module that leaves its parameters as they were has no after: record (the optimizer's step, between
    calls, moves their version counters: no change of the call's)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "plain.zarr"
    with recorder.record(path, model=model, optimizer=opt, modules=["0", "2"], mode="full"):
        for _ in range(2):
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    rec = replayer.open(path)
    assert not [r.name for s in rec.steps for r in s.records if r.name.startswith("after:")]


@recorder.paper_step("Eq. 5", description="a block around the rescaled weight")
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Rescaled(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x).tanh()


def test_an_inner_step_that_writes_its_own_parameter_is_compared_inside_its_parent(tmp_path: Path) -> None:
    """Replaying the outer step compares the inner step's parameter as the inner call left it (after:weight), as
    it compares the outer step's own after:inner.weight; an inner write changed by a swap is the inner step's
    MISMATCH."""
    torch.manual_seed(0)
    block = Block()
    path = tmp_path / "run.zarr"
    with recorder.record(path, model=block, mode="full"):
        for _ in range(2):
            block(torch.randn(3, 6))
    rec = replayer.open(path)
    outer = replayer.replay(rec, 0)
    assert outer.match and {d.name for d in outer.outputs} == {"output", "after:inner.weight"}
    assert [s.step.name for s in outer.inner] == ["Rescaled"]
    assert {d.name for d in outer.inner[0].diffs} == {"output", "after:weight"}

    def doubling(m: nn.Module) -> nn.Module:
        m.scale = 2.0
        return m

    swapped = replayer.replay(rec, 0, swap={"inner": doubling})
    diffs = {d.name: d for d in swapped.inner[0].diffs}
    assert not swapped.match and diffs["output"].match and not diffs["after:weight"].match
