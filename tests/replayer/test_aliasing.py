"""One tensor passed as several arguments (self-attention's query, key and value) stays one object:
while recording, as without it (code that asks ``query is key`` takes the same path), and in the
replay; it is recorded once, its gradient once (the total). A tensor passed both directly and inside
a list is not followed into the backward pass (the list cannot be rebuilt around a tapped tensor,
and autograd would sum its gradients in another order): training is unchanged, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import recorder
import replayer
from recorder.errors import ReplayError

SEEN: list[tuple[bool, ...]] = []


@recorder.paper_step("Eq. 3", description="q k v, self-attention when they are one tensor")
def mix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, extra: torch.Tensor) -> torch.Tensor:
    SEEN.append((q is k, k is v, extra is q))
    if q is k and k is v:  # a branch on identity, as nn.MultiheadAttention's packed projection
        return (q * 3).tanh() + extra
    return q.tanh() + k + v + extra


@recorder.paper_step("Eq. 4", description="a tensor, and a list holding it")
def pooled(x: torch.Tensor, pool: list[torch.Tensor]) -> torch.Tensor:
    SEEN.append((pool[0] is x,))
    return x.tanh() * 0.5 + x * 0.25 + pool[0].sin() * 0.25


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(8, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        h = pooled(mix(h, h, h, extra=h), [x])
        h = pooled(h, [h])
        return self.attn(h, h, h, need_weights=False)[0]


def train(path: Path | None) -> tuple[list[float], list[tuple[bool, ...]]]:
    SEEN.clear()
    torch.manual_seed(0)
    net = Net()
    attn_saw: list[tuple[bool, bool]] = []
    net.attn.register_forward_pre_hook(lambda m, a: attn_saw.append((a[0] is a[1], a[1] is a[2])))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x = torch.randn(4, 6, 8)
    losses = []

    def loop() -> None:
        for _ in range(2):
            loss = net(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        net.eval()
        with torch.no_grad():  # the fast path of nn.MultiheadAttention, taken only when query is key is value
            losses.append(net(x).sum().item())

    if path is None:
        loop()
    else:
        with recorder.record(path, model=net, optimizer=opt, mode="full", modules=["attn"]) as run:
            loop()
        assert run.status == "complete" and run.failure is None
    return losses, [*SEEN, *attn_saw]


def test_a_tensor_passed_several_times_stays_one_object_while_recording(tmp_path: Path) -> None:
    plain = train(None)
    recorded = train(tmp_path / "run.zarr")
    assert plain[1] == [(True, True, True), (False,), (True,)] * 3 + [(True, True)] * 3
    assert recorded == plain  # the same identities, so the same losses, bit for bit


def test_it_is_recorded_once_and_replayed_as_one_object(tmp_path: Path) -> None:
    train(tmp_path / "run.zarr")
    rec = replayer.open(tmp_path / "run.zarr")
    first = rec.step("Eq. 3@iter=0")
    assert [r.name for r in first.records if r.role == "input"] == ["args.0"]
    assert first.arguments == {"args": [{"$tensor": "args.0"}] * 3, "kwargs": {"extra": {"$tensor": "args.0"}}}
    both = rec.step("Eq. 4@iter=0#1")  # x and [x], grad enabled: the list holds the untapped tensor
    assert [r.name for r in both.records if r.role == "input"] == ["args.0", "args.1.0"]
    assert any("passed both directly and inside a container" in n for n in both.extra["notes"])
    evaluated = rec.step("Eq. 4@iter=2#1")  # under no_grad: one object everywhere, one record
    assert evaluated.arguments["args"] == [{"$tensor": "args.0"}, [{"$tensor": "args.0"}]]
    backward = rec.steps.filter(name="mix", phase="backward")[0]
    grads = {r.name: backward.tensor(r.name) for r in backward.records if r.role == "grad_input"}
    assert list(grads) == ["args.0"]  # the total over its three uses, as autograd gives it
    unfollowed = []
    for step in rec.steps:
        if step.phase == "backward" and not any(r.role in ("grad_input", "param_grad") for r in step.records):
            with pytest.raises(ReplayError, match="nothing to compare"):  # x and [x]: neither followed
                replayer.replay(rec, step.index)
            unfollowed.append(step.selector)
            continue
        result = replayer.replay(rec, step.index)
        assert result.match, (step.index, step.name, step.phase, [d.summary() for d in result.outputs])
    assert unfollowed == ["pooled@iter=0#1:backward", "pooled@iter=1#1:backward"]


@recorder.paper_step("Eq. 5", description="keys with dots in them")
def dotted(x: torch.Tensor, **extra: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"logits.main": x.tanh() * extra["w.scale"], "aux": x.sin()}


@recorder.paper_step("Eq. 6", description="the same tensor twice, out")
def twice(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = (a * b).sin()
    return y, y


def test_edge_places_record_their_gradients_and_replay(tmp_path: Path) -> None:
    """A kwarg or output key with a dot in its name is a top-level place; a tensor returned twice is
    a record per place; reentrant checkpointing of a call given one tensor twice records no partial
    gradient; under vmap, a call given one tensor twice and returning one twice replays."""
    torch.manual_seed(0)
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, requires_grad=True)
    with recorder.record(tmp_path / "run.zarr", mode="full"):
        out = dotted(x * 1, **{"w.scale": w * 1})
        (out["logits.main"].sum() + out["aux"].sum()).backward()
        h = x * 1
        torch.utils.checkpoint.checkpoint(lambda a, b: twice(a, b)[1], h, h, use_reentrant=True).sum().backward()
        torch.func.vmap(twice)(x.detach(), x.detach())
    rec = replayer.open(tmp_path / "run.zarr")
    back = rec.steps.filter(name="dotted", phase="backward")[0]
    assert {(r.role, r.name) for r in back.records} >= {("grad_output", "output.logits.main"),
                                                          ("grad_input", "args.0"), ("grad_input", "kwargs.w.scale")}
    checkpointed = rec.steps.filter(name="twice", phase="backward")[0]
    assert [r.role for r in checkpointed.records if r.role == "grad_input"] == []
    vmapped = rec.steps.filter(name="twice")[-1]
    assert [r.name for r in vmapped.records if r.role == "output"] == ["output.0", "output.1"]
    with pytest.raises(ReplayError, match="nothing to compare"):  # not reported as a match of nothing
        replayer.replay(rec, checkpointed.index)
    for step in rec.steps:
        if step.index != checkpointed.index:
            result = replayer.replay(rec, step.index)
            assert result.match, (step.index, step.name, step.phase, [d.summary() for d in result.outputs])
