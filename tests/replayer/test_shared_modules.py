"""One weight or one submodule reached by two paths inside a replayed step: an output layer tied to the
embedding (``head.weight = emb.weight``), two experts sharing a projection (``experts[1].fc2 =
experts[0].fc2``). With the enclosing step and the modules that share it all recorded, the enclosing
step replays bit for bit, inner steps included: the shared submodule is rebuilt as one module, whose
second call pairs with its recorded call, and each inner call's own share of a shared parameter's
gradient is compared with the share its replayed call sends (a false MISMATCH before, while ``pdbg
verify`` said 100%). A real change still differs."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import recorder
import replayer
from recorder import skeleton


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tok: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(tok)))


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList([Expert(), Expert()])
        self.experts[1].fc2 = self.experts[0].fc2  # a shared output projection

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts[0](x) + self.experts[1](x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.moe = MoE()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x)


def _train_lm(path: Path) -> replayer.Recording:
    torch.manual_seed(0)
    lm = TiedLM()
    opt = torch.optim.SGD(lm.parameters(), lr=0.1)
    with recorder.record(path, optimizer=opt, mode="full", modules=["**"]):
        for _ in range(2):
            tok = torch.randint(0, 10, (5,))
            nn.functional.cross_entropy(lm(tok), tok).backward()
            opt.step()
            opt.zero_grad()
    return replayer.open(path)


def _train_moe(path: Path, modules: list[str]) -> replayer.Recording:
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with recorder.record(path, optimizer=opt, mode="full", modules=modules):
        for _ in range(2):
            net(torch.randn(3, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    return replayer.open(path)


def _failing(result: replayer.ReplayResult) -> list[object]:
    return [(s.step.index, s.step.module_path, s.reason, [d.summary() for d in s.diffs if not d.match])
            for s in result.inner if not s.match]


def _param_grads(result: replayer.ReplayResult, module_path: str) -> set[str]:
    """The parameter grads the inner backward steps at ``module_path`` compared (all matched)."""
    return {d.name for s in result.inner if s.step.module_path == module_path
            for d in s.diffs if d.role == "param_grad" and d.match}


def test_the_skeleton_names_a_submodule_reached_by_a_second_path() -> None:
    """The paths that reach a module already reached by another are recorded, the top one only."""
    assert skeleton.build(Net())["shared_modules"] == {"moe.experts.1.fc2": "moe.experts.0.fc2"}
    moe = MoE()
    moe.experts[1] = moe.experts[0]  # a whole expert shared: its children are shared with it
    assert skeleton.build(moe)["shared_modules"] == {"experts.1": "experts.0"}
    assert "shared_modules" not in skeleton.build(Expert())


def test_a_model_with_a_tied_head_replays_its_backward_with_each_inner_share(tmp_path: Path) -> None:
    """The model's backward: the head's and the embedding's steps each compare their own share of the
    tied weight's gradient (the head's was "not produced during the replay", the embedding's was
    compared with the whole gradient), bit for bit."""
    rec = _train_lm(tmp_path / "run.zarr")
    for it in (0, 1):
        result = replayer.replay(rec, f".@iter={it}:backward")
        assert result.match and len(result.inner) == 2, _failing(result)
        assert _param_grads(result, "head") == {"weight"} and _param_grads(result, "emb") == {"weight"}
        assert replayer.replay(rec, f".@iter={it}").match
    edited = replayer.replay(rec, ".@iter=0:backward", edit={"emb.weight": "x * 1.001"})
    assert not edited.match and not any(s.match for s in edited.inner)


def test_a_submodule_two_experts_share_is_rebuilt_once_and_its_calls_pair(tmp_path: Path) -> None:
    """Everything recorded: the MoE step's forward rebuilds 7 modules (8 before, the shared one twice,
    whose second call was then "recorded, but not called during the replay"); its backward compares
    each call's share of the shared projection's gradient, bit for bit."""
    rec = _train_moe(tmp_path / "run.zarr", ["**"])
    for it in (0, 1):
        forward = replayer.replay(rec, f"moe@iter={it}#0")
        assert forward.match and len(forward.rebuilt) == 7 and len(forward.inner) == 6, _failing(forward)
        assert forward.unrecorded_inner is None
        backward = replayer.replay(rec, f"moe@iter={it}#0:backward")
        assert backward.match and len(backward.inner) == 6, _failing(backward)
        assert {"fc2.weight", "fc2.bias"} <= _param_grads(backward, "moe.experts.1")
        assert {"weight", "bias"} <= _param_grads(backward, "moe.experts.0.fc2")  # its two calls, each its own
        assert replayer.replay(rec, f".@iter={it}:backward").match
    edited = replayer.replay(rec, "moe@iter=0#0:backward", edit={"moe.experts.1/args.0": "x * 1.001"})
    assert not edited.match
    assert not next(s for s in edited.inner if s.step.module_path == "moe.experts.1").match


def test_experts_sharing_a_submodule_recorded_without_it_replay_their_shares(tmp_path: Path) -> None:
    """The MoE step and its experts recorded, the shared projection not: each expert's backward step
    compares its own share of the projection's gradient (experts.1's was "not produced", experts.0's
    held both shares), bit for bit."""
    rec = _train_moe(tmp_path / "run.zarr", ["moe", "moe.experts.*"])
    result = replayer.replay(rec, "moe@iter=0#0:backward")
    assert result.match and len(result.inner) == 2, _failing(result)
    for path in ("moe.experts.0", "moe.experts.1"):
        assert {"fc2.weight", "fc2.bias", "fc1.weight", "fc1.bias"} == _param_grads(result, path)


@recorder.paper_step("Algorithm 1", step=4, description="the critic")
class Critic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@recorder.paper_step("Eq. 3", description="the gradient penalty")
class GradPenalty(nn.Module):
    def __init__(self, critic: nn.Module) -> None:
        super().__init__()
        self.D = critic

    def forward(self, real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
        x = (0.3 * real + 0.7 * fake).requires_grad_(True)
        g, = torch.autograd.grad(self.D(x).sum(), x, create_graph=True)
        return ((g.norm(2, dim=1) - 1) ** 2).mean()


class WGAN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.D = Critic()  # the model's path of the critic, reached first: its calls are recorded as "D"
        self.gp = GradPenalty(self.D)


def test_a_penalty_holding_the_models_critic_replays_its_inner_call(tmp_path: Path) -> None:
    """A gradient penalty module holding the critic the model holds too (``self.D = model.D``): its
    call of the critic, recorded at ``D``, runs at ``gp.D`` in the replay of the penalty step. Forward
    and backward replay bit for bit, the critic's inner step compared (it was "recorded, but not called
    during the replay", a MISMATCH, while ``pdbg verify`` said 100%; the backward also compared the
    interpolates' first-order gradient, and the critic's bias total, all the loss's other terms' own)."""
    torch.manual_seed(0)
    gan = WGAN()
    opt = torch.optim.SGD(gan.parameters(), lr=0.1)
    path = tmp_path / "run.zarr"
    with recorder.record(path, model=gan, optimizer=opt, mode="full"):
        for _ in range(2):
            real, fake = torch.randn(8, 2), torch.randn(8, 2)
            loss = gan.D(fake).mean() - gan.D(real).mean() + 10 * gan.gp(real, fake)
            opt.zero_grad()
            loss.backward()
            opt.step()
    rec = replayer.open(path)
    for it in (0, 1):
        forward = replayer.replay(rec, f"Eq. 3@iter={it}")
        assert forward.match and [s.step.module_path for s in forward.inner] == ["D"], _failing(forward)
        assert forward.inner[0].diffs and all(d.match for d in forward.inner[0].diffs)
        backward = replayer.replay(rec, f"Eq. 3@iter={it}:backward")
        assert backward.match and len(backward.inner) == 1, _failing(backward)
        assert {"net.0.weight", "net.2.weight"} <= _param_grads(backward, "D")
        assert any(d.role == "grad_input" and d.match for d in backward.inner[0].diffs)
    edited = replayer.replay(rec, "Eq. 3@iter=1", edit={"args.0": "x * 1.001"})
    assert not edited.match and not edited.inner[0].match
    bundle = replayer.bundle(rec, rec.step("Eq. 3@iter=1").index, tmp_path / "gp.pdbg", verify=True)
    assert bundle.verified is True
