"""Model surgery while recording: a submodule swapped for another class, a weight tied, a hook registered
mid-run. The steps after the change replay from the module as it was then, not as its first recorded
call found it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import recorder
import replayer
from tests.cli import pdbg

VOCAB, WIDTH = 11, 8


class ActBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.fc(x))


class TiedCore(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.mid = nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tok: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(self.emb(tok)))).mean(1)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, WIDTH)
        self.block = ActBlock()
        self.core = TiedCore()

    def forward(self, x: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        return self.block(self.inp(x)).sum(1, keepdim=True) + self.core(tok)


def _halve(module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor:
    return out * 0.5


def _train(path: Path | None, surgery: Callable[[Net], None], iterations: int = 3) -> list[torch.Tensor]:
    """Surgery before iteration 1; the losses of every iteration."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, 4, generator=g), torch.randint(0, VOCAB, (6, 5), generator=g),
                torch.randint(0, VOCAB, (6,), generator=g)) for _ in range(iterations)]
    losses = []
    with recorder.record(path, model=model, optimizer=opt, mode="full", modules=["block", "core"]) if path \
            else _nothing():
        for it, (x, tok, y) in enumerate(batches):
            if it == 1:
                surgery(model)
            loss = F.cross_entropy(model(x, tok), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach().clone())
    return losses


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _recorded(tmp_path: Path, surgery: Callable[[Net], None]) -> replayer.Recording:
    plain, path = _train(None, surgery), tmp_path / "run.zarr"
    recorded = _train(path, surgery)
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(plain, recorded))
    return replayer.open(path)


def _swap_activation(model: Net) -> None:
    model.block.act = nn.SiLU()


def _tie(model: Net) -> None:
    model.core.out.weight = model.core.emb.weight


def _hook(model: Net) -> None:
    model.block.fc.register_forward_hook(_halve)


def _replay_after_the_change(rec: replayer.Recording, path: str) -> None:
    """The steps of the module at ``path`` after the change (iterations 1 and 2, forward and backward) replay
    bit for bit."""
    after = [s for s in rec.steps if s.module_path == path and s.iteration >= 1]
    assert len(after) == 4, [(s.module_path, s.phase, s.iteration) for s in rec.steps]
    for step in after:
        res = replayer.replay(rec, step)
        assert res.match, (step, res.outputs, res.warnings)


def test_an_activation_swapped_mid_run_for_another_class_with_the_same_attributes_replays(tmp_path: Path) -> None:
    """nn.ReLU and nn.SiLU hold the same attributes (inplace=False): the skeleton the first call recorded stayed
    the block's, so every later step replayed ReLU and differed."""
    rec = _recorded(tmp_path, _swap_activation)
    _replay_after_the_change(rec, "block")
    assert replayer.replay(rec, "block@iter=0").match


def test_a_weight_tied_mid_run_inside_a_recorded_module_replays(tmp_path: Path) -> None:
    """``out.weight = emb.weight`` after the first call: the skeleton had no ``tied`` entry, so the tied
    steps' replays raised (the parameter recorded once, under its first name) and were not replayed."""
    rec = _recorded(tmp_path, _tie)
    _replay_after_the_change(rec, "core")


def test_a_hook_registered_mid_run_on_a_submodule_is_named_by_the_replay(tmp_path: Path) -> None:
    """A forward hook registered on ``block.fc`` after the first call: the replay, which runs without it,
    differed saying nothing; as for a hook there from the start, it names the hook as the likely cause."""
    rec = _recorded(tmp_path, _hook)
    res = replayer.replay(rec, "block@iter=1")
    assert not res.match
    assert any(w.startswith("fc had a forward hook _halve") for w in res.warnings), res.warnings
    before = replayer.replay(rec, "block@iter=0")
    assert before.match and not any("_halve" in w for w in before.warnings), before.warnings


def test_info_says_a_module_replaced_mid_run_may_be_why_a_path_has_two_objects(tmp_path: Path) -> None:
    """A new head put in mid-run makes two module objects at one path: pdbg info named only a model and its copy
    (an EMA teacher) as the reason, which a user who replaced the head does not recognise."""
    torch.manual_seed(0)
    model = Net()
    path = tmp_path / "run.zarr"
    with recorder.record(path, model=model, mode="full", modules=["block.fc"]) as run:
        for it in range(2):
            if it == 1:
                model.block.fc = nn.Linear(WIDTH, WIDTH)
            model(torch.randn(6, 4), torch.randint(0, VOCAB, (6, 5))).sum().backward()
            run.next_iteration()
    res = pdbg("info", str(path), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "Linear: 2 module objects at one module path (a model and its copy, such as an EMA teacher, or a module " \
           "replaced mid-run)" in res.stdout, res.stdout
