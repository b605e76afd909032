"""Modules given to a step as arguments (a soft target update's networks, an ensemble's list of members, a
method's ``self.net``): recorded as data (``$module``: skeleton, parameters, buffers), rebuilt by a replay,
and what the call wrote into their parameters compared bit for bit. Before schema 1.30 such a step was
recorded but its replay was refused ("could not be recorded as data")."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from torch import nn

import recorder
import replayer
from recorder import jsonval
from recorder.errors import ReplayError, UnknownTagError
from tests.cli import pdbg


@recorder.paper_step("Eq. 6", description="soft target update")
def soft_update(target: nn.Module, online: nn.Module, tau: float) -> None:
    with torch.no_grad():
        for tp, p in zip(target.parameters(), online.parameters(), strict=True):
            tp.mul_(1 - tau).add_(tau * p)


def soft_update_twice(target: nn.Module, online: nn.Module, tau: float) -> None:
    """Another update than the recorded one: a replay swapped to it must differ."""
    soft_update.__wrapped__(target, online, 2 * tau)


@recorder.paper_step("Eq. 9", description="ensemble mean")
def ensemble(models: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    return torch.stack([m(x) for m in models]).mean(0)


class Agent:
    def __init__(self) -> None:
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2), nn.BatchNorm1d(2))

    @recorder.paper_step("Algorithm 1", step=3, description="act")
    def act(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs)


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _train(path: Path | None, huge_at: int | None = None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    online, target, agent = _net(), _net(), Agent()
    target.load_state_dict(online.state_dict())
    opt = torch.optim.SGD(online.parameters(), lr=0.1)
    with recorder.record(path, model=online, optimizer=opt, mode="full") if path else contextlib.nullcontext():
        for it in range(3):
            x = torch.randn(5, 4)
            loss = online(x).pow(2).mean() + ensemble([online, target], x).sum() + agent.act(x).sum() * 0
            opt.zero_grad()
            loss.backward()
            opt.step()
            tau = 0.05
            if it == huge_at:  # finite, but a tau schedule gone wrong mixes them past float32's range: inf - inf
                with torch.no_grad():
                    online[2].bias[0] = target[2].bias[0] = 3e38
                tau = 3.0
            soft_update(target, online, tau)
    return [t.detach().clone() for t in (*target.parameters(), *agent.net.buffers())]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class TestSoftUpdate:
    def test_a_soft_update_given_networks_replays_bit_for_bit(self, tmp_path: Path) -> None:
        """Each soft_update call replays: the target's parameters as the call left them (after:args.0.*) match
        bit for bit, and training is as unrecorded."""
        path = tmp_path / "run.zarr"
        recorded = _train(path)
        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(recorded, _train(None), strict=True))
        rec = replayer.open(path)
        steps = [s for s in rec.steps if s.name == "soft_update"]
        assert len(steps) == 3
        for step in steps:
            result = replayer.replay(rec, step.index)
            names = {d.name for d in result.outputs}
            assert {"after:args.0.0.weight", "after:args.0.0.bias", "after:args.0.2.weight",
                    "after:args.0.2.bias"} <= names, names
            assert result.match and all(d.match for d in result.outputs), [d.summary() for d in result.outputs]
        last = replayer.replay(rec, steps[-1].index)  # what it wrote is the target's final state, bit for bit
        assert torch.equal(_bits(last.values["after:args.0.2.bias"]), _bits(recorded[3]))

    def test_a_replay_that_updates_otherwise_is_a_mismatch(self, tmp_path: Path) -> None:
        """Swapped for an update with another tau, the replay differs on the target's parameters."""
        path = tmp_path / "run.zarr"
        _train(path)
        rec = replayer.open(path)
        step = next(s for s in rec.steps if s.name == "soft_update")
        result = replayer.replay(rec, step.index, swap={"soft_update": lambda original: soft_update_twice})
        assert not result.match and not result.diffs["after:args.0.0.weight"].match

    def test_the_soft_update_that_writes_nan_into_the_target_is_the_origin(self, tmp_path: Path) -> None:
        """Finite networks whose soft update (tau 3) makes NaN in the target (inf - inf): bisect names that call, as
        producing its argument's parameter in place from finite inputs (before, its arguments were not
        recorded, and it was only a possible writer); pdbg bisect says so too."""
        path = tmp_path / "run.zarr"
        _train(path, huge_at=1)
        rec = replayer.open(path)
        origin = replayer.first_nonfinite(rec)
        assert origin.step is not None and origin.step.name == "soft_update", origin.cause
        assert origin.step.index == [s for s in rec.steps if s.name == "soft_update"][1].index, origin.cause
        assert "after:args.0.2.bias" in origin.cause or "args.0.2.bias" in origin.cause, origin.cause
        res = pdbg("bisect", str(path), cwd=tmp_path)
        assert res.returncode == 1 and "soft_update" in res.stdout, res.stdout + res.stderr


class TestModulesInsideArguments:
    def test_a_list_of_modules_and_a_methods_self_net_replay(self, tmp_path: Path) -> None:
        """An ensemble given [online, target] and Agent.act (its self.net, with a BatchNorm whose running
        statistics the call updates in place) replay bit for bit; pdbg verify replays every forward step."""
        path = tmp_path / "run.zarr"
        _train(path)
        rec = replayer.open(path)
        for name in ("ensemble", "Agent.act"):
            steps = [s for s in rec.steps if s.name == name and s.phase == "forward"]
            assert len(steps) == 3
            for step in steps:
                result = replayer.replay(rec, step.index)
                assert result.match, (name, [d.summary() for d in result.outputs])
        act = next(s for s in rec.steps if s.name == "Agent.act")
        assert "after:args.0.net.3.running_mean" in replayer.replay(rec, act.index).diffs
        res = pdbg("verify", str(path), "--json", cwd=tmp_path)
        assert '"mismatches": []' in res.stdout, res.stdout + res.stderr

    def test_a_network_given_to_many_calls_is_stored_once(self, tmp_path: Path) -> None:
        """Agent.act called at every environment step of an iteration: its network's weights, unchanged between
        the calls, are one payload (the writer keeps each payload once by content), and each call
        replays."""
        path = tmp_path / "run.zarr"
        torch.manual_seed(0)
        agent = Agent()
        agent.net.eval()
        with recorder.record(path, mode="full"):
            for _ in range(4):
                agent.act(torch.randn(3, 4))
        rec = replayer.open(path)
        payloads = {r.payload for s in rec.steps for r in s.records if r.name == "args.0.net.0.weight"}
        assert len(payloads) == 1 and -1 not in payloads, payloads
        assert all(replayer.replay(rec, s.index).match for s in rec.steps)


def test_a_reader_without_the_module_tag_refuses_such_a_step_saying_to_upgrade(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader that does not know $module (1.29: it was added in 1.30) refuses a step given a module in one
    error that says to upgrade, rather than replaying something else; readers since 1.30 decode it."""
    path = tmp_path / "run.zarr"
    _train(path)
    rec = replayer.open(path)
    step = next(s for s in rec.steps if s.name == "soft_update")
    monkeypatch.delitem(jsonval._TAGS, "$module")
    with pytest.raises(UnknownTagError, match="upgrade paperdebugger"):
        replayer.replay(replayer.open(path), step.index)


@recorder.paper_step("Eq. 2", description="distillation loss, given the student and the teacher")
def distill_loss(student: nn.Module, teacher: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        t = teacher(x)
    return (student(x) - t).pow(2).mean()


def test_a_loss_given_the_student_replays_forward_and_says_why_not_backward(tmp_path: Path) -> None:
    """A distillation loss given student and teacher: its forward replays bit for bit; its backward, whose only
    gradients are the student's parameters', is refused in one line naming the modules whose parameter gradients
    are not followed and what records them (it was refused as given a module that is not data)."""
    torch.manual_seed(0)
    student, teacher = _net(), _net()
    path = tmp_path / "run.zarr"
    with recorder.record(path, mode="full"):
        distill_loss(student, teacher, torch.randn(5, 4)).backward()
    rec = replayer.open(path)
    forward, backward = rec.steps[0], rec.steps[1]
    assert backward.phase == "backward" and replayer.replay(rec, forward.index).match
    with pytest.raises(ReplayError, match=r"the gradients of the parameters of the modules its forward was given, "
                                          r"args\.0, args\.1, are not followed: a paper-step module holding them as "
                                          r"submodules records their parameter grads"):
        replayer.replay(rec, backward.index)


class _Scaled(nn.Module):
    def __init__(self, k: float) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.f = lambda x: x * k  # not data, and no constructor arguments recorded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.f(self.lin(x))


@recorder.paper_step("Eq. 11", description="apply a network it is given")
def apply_net(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return net(x)


def test_what_a_given_module_could_not_keep_is_named_as_that_modules(tmp_path: Path) -> None:
    """A module given as an argument holding a lambda: the replay's warning names it as the module the step was
    given, not as "the step's module" (a function step has none)."""
    path = tmp_path / "run.zarr"
    with pytest.warns(recorder.RecorderWarning, match="holds f"), recorder.record(path, mode="full"):
        apply_net(_Scaled(3.0), torch.randn(2, 4))
    result = replayer.replay(replayer.open(path), 0)
    assert any(w.startswith("the _Scaled the step was given: attributes f (a function) could not be recorded")
               for w in result.warnings), result.warnings
