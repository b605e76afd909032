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


def test_a_loss_given_the_student_replays_forward_and_backward(tmp_path: Path) -> None:
    """A distillation loss given student and teacher (the teacher used under no_grad): its forward replays bit for
    bit, and so does its backward, whose only gradients are the student's parameters' (schema 1.31: network_grad
    records args.0.*; before, the backward was refused as holding nothing to compare)."""
    torch.manual_seed(0)
    student, teacher = _net(), _net()
    path = tmp_path / "run.zarr"
    with recorder.record(path, mode="full"):
        distill_loss(student, teacher, torch.randn(5, 4)).backward()
    rec = replayer.open(path)
    forward, backward = rec.steps[0], rec.steps[1]
    assert backward.phase == "backward" and replayer.replay(rec, forward.index).match
    assert {(r.role, r.name) for r in backward.records if r.role != "grad_output"} == {
        ("network_grad", f"args.0.{n}") for n, _ in student.named_parameters()}
    result = replayer.replay(rec, backward.index)
    assert result.match and len(result.outputs) == 4, [d.summary() for d in result.outputs]
    from tui import views  # the TUI's step pane lists them

    assert [t.role for t in views.step_view(backward).tensors].count("network_grad") == 4
    for n, p in student.named_parameters():  # the only use of the student: what the call sent is its .grad
        assert torch.equal(_bits(backward.tensor(f"args.0.{n}", "network_grad")), _bits(p.grad))


@recorder.paper_step("Eq. 3", description="distillation through a trained teacher")
def distill(student_logits: torch.Tensor, teacher: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return (student_logits - teacher(x)).pow(2).mean()


@recorder.paper_step("Eq. 4", description="ensemble loss")
def ensemble_loss(nets: list[nn.Module], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return sum(((n(x) - y).pow(2).mean() for n in nets), torch.zeros(()))


@recorder.paper_step("Eq. 5", description="policy loss through the critic")
def policy_loss(actor: nn.Module, critic: nn.Module, obs: torch.Tensor) -> torch.Tensor:
    return -critic(torch.cat([obs, actor(obs)], 1)).mean()


@recorder.paper_step("Eq. 6", description="gradient penalty")
def gradient_penalty(critic: nn.Module, real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
    a = torch.rand(real.shape[0], 1)
    xi = (a * real + (1 - a) * fake).requires_grad_(True)
    g, = torch.autograd.grad(critic(xi).sum(), xi, create_graph=True)
    return (g.norm(dim=1) - 1).pow(2).mean()


@recorder.paper_step("Eq. 7", description="networks in a dict and as a keyword")
def dict_loss(nets: dict[str, nn.Module], x: torch.Tensor, *, frozen: nn.Module) -> torch.Tensor:
    return nets["a"](x).sum() + frozen(x).sum()


def _train_given_networks(path: Path | None) -> tuple[list[torch.Tensor], dict[str, nn.Module]]:
    """Every kind of step given networks whose result is backpropagated: a teacher trained through a distillation
    loss, an ensemble's list (net a shared with another step), an actor-critic, a WGAN gradient penalty, a dict
    and a frozen network given as a keyword."""
    torch.manual_seed(0)
    nets = {"student": _net(), "teacher": _net(), "a": _net(), "b": _net(), "actor": _net(),
            "critic": nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1)), "c2": _net(),
            "frozen": _net().requires_grad_(False)}
    params = [p for k, n in nets.items() if k != "frozen" for p in n.parameters()]
    opt = torch.optim.SGD(params, lr=0.01)
    with recorder.record(path, model=nets["student"], optimizer=opt, mode="full") if path else \
            contextlib.nullcontext():
        for _ in range(2):
            x, y = torch.randn(5, 4), torch.randn(5, 2)
            loss = distill(nets["student"](x), nets["teacher"], x) + ensemble_loss([nets["a"], nets["b"]], x, y)
            loss = loss + policy_loss(nets["actor"], nets["critic"], x) + gradient_penalty(nets["c2"], x, x.flip(0))
            loss = loss + dict_loss({"a": nets["a"]}, x, frozen=nets["frozen"])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return [p.detach().clone() for p in params], nets


class TestGivenNetworksBackward:
    def test_every_backward_given_networks_records_and_replays_their_gradients(self, tmp_path: Path) -> None:
        """The backward step of each call given networks holds what the call sent each of their parameters that
        requires grad (network_grad, named by its input record), and replays bit for bit; a frozen network's
        parameters have none; training is as unrecorded, and pdbg verify replays every step (before, those
        backward steps held no gradient of the networks and were refused: nothing to compare)."""
        path = tmp_path / "run.zarr"
        recorded, nets = _train_given_networks(path)
        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(recorded, _train_given_networks(None)[0],
                                                                   strict=True))
        rec = replayer.open(path)
        expected = {"distill": ["args.1"], "ensemble_loss": ["args.0.0", "args.0.1"],
                    "policy_loss": ["args.0", "args.1"], "gradient_penalty": ["args.0"], "dict_loss": ["args.0.a"]}
        backward = [s for s in rec.steps if s.phase == "backward" and s.name in expected]
        assert len(backward) == 10
        for step in backward:
            names = {r.name for r in step.records if r.role == "network_grad"}
            prefixes = {n.rsplit(".", 2)[0] for n in names}
            assert prefixes == set(expected[step.name]), (step.name, names)
            assert not any(n.startswith("kwargs.frozen") for n in names)
            result = replayer.replay(rec, step.index)
            assert result.match and {d.name for d in result.outputs} >= names, [d.summary() for d in result.outputs]
        last = [s for s in backward if s.name == "policy_loss"][-1]  # the critic's only use: its .grad, bit for bit
        for n, p in nets["critic"].named_parameters():
            assert torch.equal(_bits(last.tensor(f"args.1.{n}", "network_grad")), _bits(p.grad))
        res = pdbg("verify", str(path), "--json", cwd=tmp_path)
        assert res.returncode == 0 and '"mismatches": []' in res.stdout, res.stdout + res.stderr

    def test_a_bundle_of_such_a_backward_replays_elsewhere(self, tmp_path: Path) -> None:
        """pdbg bundle of an actor-critic's backward step, replayed from the bundle alone: bit for bit, its
        networks' gradients compared."""
        path = tmp_path / "run.zarr"
        _train_given_networks(path)
        out = tmp_path / "b.pdbg"
        assert pdbg("bundle", str(path), "policy_loss@iter=1:backward", "-o", str(out), cwd=tmp_path).returncode == 0
        res = pdbg("replay", str(out), "--json", cwd=tmp_path)
        assert res.returncode == 0 and '"role": "network_grad"' in res.stdout, res.stdout + res.stderr


class _Kinked(nn.Module):
    """Finite forward (+0), NaN in its backward: sqrt's gradient at 0 is inf, times 0."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y + (y - y.detach()).sqrt()


def test_a_nan_born_in_a_given_networks_gradient_is_found_by_bisect(tmp_path: Path) -> None:
    """A trained teacher whose backward makes NaN in its own parameters' gradients, given to a distillation loss:
    bisect names that loss's backward, producing the teacher's parameter grads from finite inputs (before, they
    were not recorded, and the origin found was a later step that read the NaN weights)."""
    torch.manual_seed(0)
    student, teacher = nn.Linear(4, 2), _Kinked()
    opt = torch.optim.SGD([*student.parameters(), *teacher.parameters()], lr=0.01)
    path = tmp_path / "run.zarr"
    with recorder.record(path, model=student, optimizer=opt, mode="full"):
        for _ in range(2):
            x = torch.randn(5, 4)
            loss = distill(student(x), teacher, x)
            opt.zero_grad()
            loss.backward()
            opt.step()
    rec = replayer.open(path)
    origin = replayer.first_nonfinite(rec)
    assert origin.step is not None and (origin.step.index, origin.step.phase) == (1, "backward"), origin.cause
    assert "network_grad args.1.lin.weight" in origin.cause, origin.cause
    res = pdbg("bisect", str(path), "--json", cwd=tmp_path)
    assert res.returncode == 1 and '"index": 1' in res.stdout, res.stdout + res.stderr


def test_a_reader_without_network_grads_refuses_such_a_backward_saying_to_upgrade(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader of 1.30, which does not know the role network_grad, refuses such a backward step in one line that
    says to upgrade (rather than comparing the gradients with none), and still replays its forward."""
    from recorder.errors import NewerSchemaError
    from recorder.store import layout

    torch.manual_seed(0)
    path = tmp_path / "run.zarr"
    with recorder.record(path, mode="full"):
        distill(torch.randn(5, 2, requires_grad=True), _net(), torch.randn(5, 4)).backward()
    monkeypatch.setattr(layout, "SCHEMA_VERSION", "1.30")
    monkeypatch.setattr(layout, "ROLES", layout.ROLES[:layout.ROLES.index("network_grad")])
    with pytest.warns(recorder.RecorderWarning, match="newer"):
        rec = replayer.open(path)
    assert replayer.replay(rec, 0).match
    with pytest.raises(NewerSchemaError, match=r"role this PaperDebugger does not know .*upgrade paperdebugger"):
        replayer.replay(rec, 1)


def test_a_recording_before_network_grads_says_to_record_again(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A 1.30 recording's backward of a step given a network it trains holds none of the network's gradients: its
    replay is refused in one line that says so and to record again with this version."""
    from recorder.capture import Session
    from tests.sealing import as_schema

    torch.manual_seed(0)
    path = tmp_path / "run.zarr"
    with monkeypatch.context() as m:
        m.setattr(Session, "_network_leaves", staticmethod(lambda *a: None))  # (what 1.30 recorded)
        with recorder.record(path, mode="full"):
            distill_loss(_net(), _net(), torch.randn(5, 4)).backward()
    as_schema(path, "1.30")
    with pytest.raises(ReplayError, match=r"modules its forward was given, args\.0, args\.1, are not followed by a "
                                          r"recording before schema 1\.31: record again"):
        replayer.replay(replayer.open(path), 1)


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


@recorder.paper_step("Algorithm 2", description="a training step around a distillation loss")
def train_step(student: nn.Module, teacher: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return distill(student(x), teacher, x) + teacher(x).pow(2).mean()


def test_an_outer_steps_backward_compares_its_inner_steps_network_grads(tmp_path: Path) -> None:
    """The backward replay of a training step that calls a distillation loss given the teacher compares that inner
    loss's teacher gradients (its network_grad records) bit for bit too, not its grad inputs alone."""
    torch.manual_seed(0)
    student, teacher = nn.Linear(4, 2), nn.Sequential(nn.Linear(4, 2), nn.Tanh())
    path = tmp_path / "run.zarr"
    with recorder.record(path, mode="full"):
        train_step(student, teacher, torch.randn(5, 4)).backward()
    rec = replayer.open(path)
    outer = next(s for s in rec.steps if s.name == "train_step" and s.phase == "backward")
    result = replayer.replay(rec, outer.index)
    inner = {s.step.name: s for s in result.inner}["distill"]
    assert {d.name for d in inner.diffs if d.role == "network_grad"} == {"args.1.0.weight", "args.1.0.bias"}, \
        [d.summary() for d in inner.diffs]
    assert result.match and inner.match and all(d.match for d in inner.diffs)


@recorder.paper_step("Eq. 12", description="apply a network it is given, checkpointed")
def apply_tanh(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return net(x).tanh()


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_checkpointed_step_given_a_network_records_its_gradients(tmp_path: Path, reentrant: bool) -> None:
    """A step given a network under activation checkpointing, reentrant too (whose forward runs without grad and
    whose backward is recorded from the recomputation): its backward step holds the network's gradients, which
    are its .grad here, and replays bit for bit (reentrant: before, none were recorded)."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    path = tmp_path / "run.zarr"
    with recorder.record(path, mode="full"):
        checkpoint(apply_tanh, net, torch.randn(3, 4, requires_grad=True), use_reentrant=reentrant).sum().backward()
    rec = replayer.open(path)
    backward = next(s for s in rec.steps if s.phase == "backward")
    for n, p in net.named_parameters():
        assert torch.equal(_bits(backward.tensor(f"args.0.{n}", "network_grad")), _bits(p.grad)), n
    assert replayer.replay(rec, backward.index).match


@recorder.paper_step("Algorithm 3", description="a teacher network that is a paper step itself")
class _Teacher(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


@recorder.paper_step("Eq. 13", description="distillation given a paper-step teacher by keyword")
def distill_by_keyword(student_logits: torch.Tensor, x: torch.Tensor, *, teacher: nn.Module) -> torch.Tensor:
    return (student_logits - teacher(x)).pow(2).mean() + teacher(2 * x).pow(2).mean()


def test_the_steps_inside_a_given_paper_step_network_are_compared(tmp_path: Path) -> None:
    """A loss given a teacher that is a paper-step module itself: a replay of the loss, forward and backward,
    compares the teacher's two calls inside it bit for bit (before, they were "not compared": the replay did not
    look for inner steps in the networks a step is given)."""
    torch.manual_seed(0)
    student, teacher = nn.Linear(4, 2), _Teacher()
    path = tmp_path / "run.zarr"
    with recorder.record(path, mode="full"):
        x = torch.randn(5, 4)
        distill_by_keyword(student(x), x, teacher=teacher).backward()
    rec = replayer.open(path)
    for phase in ("forward", "backward"):
        step = next(s for s in rec.steps if s.name == "distill_by_keyword" and s.phase == phase)
        result = replayer.replay(rec, step.index)
        assert [s.step.name for s in result.inner] == ["_Teacher", "_Teacher"], (phase, result.warnings)
        assert result.match and all(s.match for s in result.inner), phase
        assert not any("not compared" in w for w in result.warnings), result.warnings
