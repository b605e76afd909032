"""One tensor passed as several arguments (self-attention's query, key and value) stays one object:
while recording, as without it (code that asks ``query is key`` takes the same path), and in the
replay; it is recorded once, its gradient once (the total). So does one passed both directly and inside
a list (the list holds the tapped tensor while the call runs). A parameter passed both directly and inside
a list is the parameter itself in both places (no tap takes a leaf argument): training is unchanged, bit
for bit, and its gradient, the sum of its uses in the call's graph, is recorded and replays."""

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
    both = rec.step("Eq. 4@iter=0#1")  # h and [h], grad enabled: one tapped object in both places, one record
    assert [r.name for r in both.records if r.role == "input"] == ["args.0"]
    assert both.arguments["args"] == [{"$tensor": "args.0"}, [{"$tensor": "args.0"}]]
    assert not any("has no gradient recorded" in n for n in both.extra.get("notes", []))
    evaluated = rec.step("Eq. 4@iter=2#1")  # under no_grad: one object everywhere, one record
    assert evaluated.arguments["args"] == [{"$tensor": "args.0"}, [{"$tensor": "args.0"}]]
    backward = rec.steps.filter(name="mix", phase="backward")[0]
    grads = {r.name: backward.tensor(r.name) for r in backward.records if r.role == "grad_input"}
    assert list(grads) == ["args.0"]  # the total over its three uses, as autograd gives it
    assert [r.name for r in rec.step("pooled@iter=0#1:backward").records if r.role == "grad_input"] == ["args.0"]
    for step in rec.steps:
        result = replayer.replay(rec, step.index)
        assert result.match, (step.index, step.name, step.phase, [d.summary() for d in result.outputs])


def test_a_parameter_passed_directly_and_inside_a_list_is_itself_in_both_and_followed(tmp_path: Path) -> None:
    """A leaf given directly and inside a list is the caller's tensor in both places; its gradient, the
    sum of its uses in the call's graph (found without a tap), is recorded and replays bit for bit."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 8))
    plain = pooled(w, [w])
    (plain * 1.5).sum().backward()
    expected, w.grad = w.grad, None
    with recorder.record(tmp_path / "run.zarr", mode="full"):
        recorded = pooled(w, [w])
        (recorded * 1.5).sum().backward()
    assert torch.equal(plain, recorded) and SEEN[-2:] == [(True,), (True,)]  # the list holds w itself
    assert torch.equal(w.grad, expected)
    step = replayer.open(tmp_path / "run.zarr").step("Eq. 4@iter=0")
    assert not any("has no gradient recorded" in n for n in step.extra.get("notes", []))
    backward = step.rec.steps.filter(phase="backward")[0]
    recorded_grad = backward.tensor("args.0")
    assert [r.name for r in backward.records if r.role == "grad_input"] == ["args.0"]
    assert torch.equal(recorded_grad.view(torch.int32), expected.view(torch.int32))  # all of it came through the call
    result = replayer.replay(step.rec, backward.index)
    assert result.match and [d.name for d in result.outputs] == ["args.0"], [d.summary() for d in result.outputs]


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


@recorder.paper_step("Eq. 7", description="two overlapping windows of one buffer, one changed in place")
def windows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a.mul_(2.0)  # b sees it: the windows share memory
    return a * b + b


def _windowed(path: Path | None) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    h = torch.randn(3, 12, requires_grad=True)
    with recorder.record(path, mode="full") if path is not None else torch.enable_grad():
        buf = h * 1.5
        out = windows(buf[:, 0:8], buf[:, 4:12])
        out.sum().backward()
    return out.detach(), h.grad


def test_arguments_sharing_memory_train_as_unrecorded_and_replay_as_views_of_one_storage(tmp_path: Path) -> None:
    """Two argument views of one buffer, one changed in place by the step: a tap on each would make
    them two objects for autograd, and the in-place change would no longer reach the other's
    gradient. They are left untapped, so training is as without recording, bit for bit; a replay
    gives them one storage again, so the step's output replays bit for bit."""
    plain = _windowed(None)
    recorded = _windowed(tmp_path / "run.zarr")
    assert torch.equal(recorded[0], plain[0]) and torch.equal(recorded[1], plain[1])
    rec = replayer.open(tmp_path / "run.zarr")
    fwd = rec.steps.filter(name="windows", phase="forward")[0]
    assert any(n.startswith("args.0, args.1: share memory") for n in fwd.extra["notes"])
    assert fwd.extra["aliases"] == {"args.0": [0, 0], "args.1": [0, 4]}
    result = replayer.replay(rec, fwd.index)
    assert result.match and result.warnings == []
    back = rec.steps.filter(name="windows", phase="backward")[0]
    with pytest.raises(ReplayError, match=r"arguments args\.0, args\.1 shared memory"):
        replayer.replay(rec, back.index)


@recorder.paper_step("Eq. 8", description="a tied projection: the embedding's weight passed in")
class TiedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)

    def forward(self, idx: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        SEEN.append((weight is self.emb.weight,))
        return self.emb(idx) @ weight.t()


def test_a_module_given_its_own_parameter_replays_its_backward(tmp_path: Path) -> None:
    """A module step given its own parameter as an argument gets the parameter itself; its recorded
    parameter grad holds what came through the argument too (no grad input is recorded for the
    argument apart), and a replay passes the rebuilt parameter there, so the parameter's gradient
    replays bit for bit."""
    torch.manual_seed(0)
    head = TiedHead()
    with recorder.record(tmp_path / "run.zarr", model=head, mode="full"):
        head(torch.randint(0, 11, (5,)), head.emb.weight).logsumexp(-1).mean().backward()
    assert SEEN[-1] == (True,)
    rec = replayer.open(tmp_path / "run.zarr")
    assert rec.steps[0].extra["parameter_args"] == {"args.1": "emb.weight"}
    for step in rec.steps:
        result = replayer.replay(rec, step.index)
        assert result.match, (step.index, step.phase, [d.summary() for d in result.outputs])
        assert {d.name for d in result.outputs} == ({"output"} if step.phase == "forward" else {"emb.weight"})


@recorder.paper_step("Eq. 9", description="per-timestep states of a batch-first sequence")
def per_step(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return x.cumsum(1).unbind(1)


def test_many_views_of_one_tensor_are_each_followed(tmp_path: Path) -> None:
    """A step returning many disjoint views whose byte ranges all overlap (``unbind(1)``: told apart
    by counting bytes) follows each for gradients, and its backward replays."""
    x = torch.randn(3, 200, 2, requires_grad=True)
    with recorder.record(tmp_path / "run.zarr", mode="full"):
        torch.stack(per_step(x * 1)[::2]).sum().backward()
    rec = replayer.open(tmp_path / "run.zarr")
    back = rec.steps.filter(name="per_step", phase="backward")[0]
    assert {r.name for r in back.records if r.role == "grad_output"} == {f"output.{k}" for k in range(0, 200, 2)}
    assert replayer.replay(rec, back.index).match


@recorder.paper_step("Eq. 9", description="shift a cache window in place, then mix it with the window ahead")
def shift_mix(window: torch.Tensor, ahead: torch.Tensor) -> torch.Tensor:
    window.mul_(0.5)  # ahead overlaps window: it sees this
    return window * 2 + ahead


def test_arguments_sharing_memory_that_need_no_gradient_replay_as_views_of_one_storage(tmp_path: Path) -> None:
    """Overlapping views of a buffer that needs no gradient (a KV cache's window, or any under no_grad)
    were given a storage each by a replay: the step's in-place change no longer reached the other view,
    and verify reported a MISMATCH with no word of why."""
    path = tmp_path / "run.zarr"
    with recorder.record(path, mode="full"):
        cache = torch.randn(10)
        shift_mix(cache[0:6], cache[2:8])
        with torch.no_grad():
            g = torch.randn(10, requires_grad=True)
            shift_mix(g[0:6], g[2:8])
    with replayer.open(path) as rec:
        for step in rec.steps:
            assert step.extra["aliases"] == {"args.0": [0, 0], "args.1": [0, 2]}  # one storage, elements 0 and 2 on
            result = replayer.replay(rec, step.index)
            assert result.match, (step.index, [d.summary() for d in result.outputs], result.warnings)
            assert not any("share memory" in n for n in step.extra.get("notes", [])), step.extra  # no gradient note


@recorder.paper_step("Eq. 9", description="a sequence and its first row broadcast over it")
def with_first(x: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    return x * 2 + first


def test_an_expanded_view_sharing_memory_with_another_argument_replays(tmp_path: Path) -> None:
    """``f(h, h[:1].expand(6, 4))`` and an overlapping ``as_strided`` window: views that reach one element
    from several places (stride 0) could not be written into, and a replay of the step (and every
    ``pdbg verify`` of the run) stopped with torch's "more than one element of the written-to tensor"."""
    path = tmp_path / "run.zarr"
    with recorder.record(path, mode="full"):
        h = torch.randn(6, 4)
        with_first(h, h[:1].expand(6, 4))
        flat = torch.randn(24)
        with_first(flat[:20].view(5, 4), flat.as_strided((5, 4), (2, 1), 1))
    with replayer.open(path) as rec:
        assert len(rec.steps) == 2
        for step in rec.steps:
            assert step.extra["aliases"]
            result = replayer.replay(rec, step.index)
            assert result.match, (step.index, [d.summary() for d in result.outputs], result.warnings)


@recorder.paper_step("Eq. 2", description="coupled L2 decay added into the gradient in place, then the update")
def l2_update(param: torch.Tensor, grad: torch.Tensor, lr: float, wd: float) -> None:
    grad.add_(param, alpha=wd)  # grad is param.grad: the parameter's gradient changes too
    param.add_(grad, alpha=-lr)


@recorder.paper_step("Eq. 2", description="the same over lists, with torch's foreach operations")
def l2_update_all(params: list[torch.Tensor], grads: list[torch.Tensor], lr: float, wd: float) -> None:
    torch._foreach_add_(grads, params, alpha=wd)
    torch._foreach_add_(params, grads, alpha=-lr)


@recorder.paper_step("Eq. 2", description="an update that reads the gradient, given a view of the parameter too")
def update_and_head(param: torch.Tensor, head: torch.Tensor, lr: float) -> torch.Tensor:
    param.add_(param.grad, alpha=-lr)
    return head * 2


def test_a_gradient_given_with_its_parameter_replays_as_one_tensor(tmp_path: Path) -> None:
    """An update step given ``(p, p.grad)`` that changes the gradient in place: the recording says that
    the argument and ``p.grad`` are one tensor (``aliases``), and a replay gives them one storage, so the
    change reaches ``after:args.0:grad`` as it did. Before, the replay set ``p.grad`` apart and said
    MISMATCH (``pdbg verify``: half the steps of a deterministic run did not replay)."""
    path = tmp_path / "run.zarr"
    with recorder.record(path, mode="full"):
        p = nn.Parameter(torch.linspace(-1, 1, 6))
        q = nn.Parameter(torch.linspace(-2, 1, 5))
        p.grad, q.grad = torch.full((6,), 0.25), torch.linspace(0.1, 0.3, 5)
        with torch.no_grad():
            l2_update(p, p.grad, 0.1, 0.01)
            l2_update_all([p, q], [p.grad, q.grad], 0.1, 0.01)
            update_and_head(p, p[:3], 0.1)  # (the parameter shares memory with an argument: its .grad is set too)
    with replayer.open(path) as rec:
        single, lists, viewed = rec.steps
        assert viewed.extra["aliases"] == {"args.0": [0, 0], "args.1": [0, 0]}
        assert single.extra["aliases"] == {"args.1": [0, 0], "args.0:grad": [0, 0]}
        assert {n: place[1] for n, place in lists.extra["aliases"].items()} == {
            "args.0.0:grad": 0, "args.1.0": 0, "args.0.1:grad": 0, "args.1.1": 0}
        assert {"after:args.0:grad", "after:args.1"} <= {r.name for r in single.records}
        for step in rec.steps:
            result = replayer.replay(rec, step.index)
            assert result.match and not result.warnings, (step.index, [d.summary() for d in result.outputs])
            assert all(d.mismatched == 0 for d in result.outputs) and any(  # (bit for bit)
                d.name.endswith(":grad") or d.name == "after:args.0" for d in result.outputs)
