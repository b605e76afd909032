"""Each backward step records its own pass's parameter gradients, bit for bit as autograd computes
them apart: with gradient accumulation, clipping after backward, torch.autograd.grad, a module
called twice, a post-accumulate-grad hook that changes .grad, two graphs built before either
backward, a second backward through a retained graph, and a backward pass that raises."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import recorder
import replayer
from recorder.store.reader import RunReader
from tests.recorder.readback import raw, step_rows


class Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        raise FloatingPointError("boom in backward")


class Routed(torch.nn.Linear):
    """Keeps an auxiliary loss of its weight (as mixture-of-experts routers keep theirs)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.aux = self.weight.square().sum()
        return super().forward(x)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = Routed(6, 6)
        self.b = torch.nn.Linear(6, 3)
        self.shape = "plain"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shape == "shared":  # a called twice
            return self.b(torch.tanh(self.a(torch.tanh(self.a(x)))))
        if self.shape == "boom":
            return self.b(Boom.apply(torch.tanh(self.a(x))))
        return self.b(torch.tanh(self.a(x)))


def batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(5, 6, generator=g) for _ in range(n)]


def accumulated(net: Net, opt: torch.optim.Optimizer) -> None:
    """Micro-batches adding into .grad: the second backward's own gradient, not the sum."""
    for i, x in enumerate(batches(4)):
        net(x).square().mean().backward()
        if i % 2:
            opt.step()
            opt.zero_grad(set_to_none=True)


def forwards_then_backwards(net: Net, opt: torch.optim.Optimizer) -> None:
    """Both forwards see .grad None; the second backward adds to the first one's."""
    x, y = batches(2)
    la, lb = net(x).square().mean(), net(y).abs().mean()
    la.backward()
    lb.backward()
    opt.step()


def clipped(net: Net, opt: torch.optim.Optimizer) -> None:
    """Clipping scales .grad in place after backward: the recording keeps what backward computed."""
    for x in batches(2):
        (net(x).square().mean() * 100).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1e-3)
        opt.step()
        opt.zero_grad(set_to_none=True)


def functional(net: Net, opt: torch.optim.Optimizer) -> None:
    """torch.autograd.grad: the gradients go back to the caller, .grad stays None."""
    for x in batches(2):
        grads = torch.autograd.grad(net(x).square().mean(), list(net.parameters()))
        with torch.no_grad():
            for p, g in zip(net.parameters(), grads):
                p.sub_(0.1 * g)


def twice_through_one_graph(net: Net, opt: torch.optim.Optimizer) -> None:
    """A second backward through a retained graph adds to .grad."""
    loss = net(batches(1)[0]).square().mean()
    loss.backward(retain_graph=True)
    loss.backward()


def auxiliary_first(net: Net, opt: torch.optim.Optimizer) -> None:
    """A backward pass of the auxiliary loss alone (a's weight only, none through a's output), then
    one of the main loss through the same graph."""
    out = net(batches(1)[0])
    net.a.aux.backward(retain_graph=True)
    out.square().mean().backward()


def shared_call(net: Net, opt: torch.optim.Optimizer) -> None:
    """One module called twice: each backward step gets its call's share of the parameter's gradient."""
    net.shape = "shared"
    net(batches(1)[0]).sum().backward()
    opt.step()


def _triple(p: torch.Tensor) -> None:
    p.grad.mul_(-3.0)


def stepped_in_backward(net: Net, opt: torch.optim.Optimizer) -> None:
    """A post-accumulate-grad hook that changes .grad during backward (an optimizer step in backward)."""
    handles = [p.register_post_accumulate_grad_hook(_triple) for p in net.a.parameters()]
    for x in batches(2):
        net(x).square().mean().backward()
        opt.zero_grad(set_to_none=True)
    for h in handles:
        h.remove()


def raised_in_backward(net: Net, opt: torch.optim.Optimizer) -> None:
    """A backward pass that raises after b's gradients and before a's: the recording closes on it."""
    net.shape = "boom"
    net(batches(1)[0]).sum().backward()


def record(path: Path, scenario: Callable[[Net, torch.optim.Optimizer], None]) -> None:
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    try:
        with recorder.record(path, model=net, modules=["a", "b"], mode="full"):
            scenario(net, opt)
    except FloatingPointError:
        assert scenario is raised_in_backward


def fresh() -> Net:
    torch.manual_seed(0)
    return Net()


def grads_of(loss: torch.Tensor, module: torch.nn.Module) -> dict[str, bytes]:
    w, b = torch.autograd.grad(loss, [module.weight, module.bias])
    return {"weight": raw(w), "bias": raw(b)}


def param_grads(path: Path, module: str) -> list[dict[str, bytes]]:
    """The param_grad bytes of each backward step of ``module``, in step order."""
    rank = RunReader(path).rank(0)
    out = []
    for i in range(len(rank)):
        col = lambda n: int(rank.column(f"steps/{n}")[i])  # noqa: E731
        if col("phase") == 1 and rank.doc(col("module_path")) == module:
            out.append({r.name: raw(rank.tensor(r)) for r in rank.tensor_records(i) if r.role == "param_grad"})
    return out


def test_each_backward_pass_records_its_own_gradients(tmp_path: Path) -> None:
    """Two graphs built before either backward runs, and a second backward through a retained
    graph: each backward step records the gradient of its own pass (a hook is per tensor, not per
    graph: one that fires before its call's backward began is another graph's, and a second pass
    through one graph hooks the parameters again)."""
    record(tmp_path / "two.zarr", forwards_then_backwards)
    record(tmp_path / "again.zarr", twice_through_one_graph)
    net = fresh()
    x, y = batches(2)
    want = [grads_of(net(x).square().mean(), net.a), grads_of(net(y).abs().mean(), net.a)]
    assert param_grads(tmp_path / "two.zarr", "a") == want
    net = fresh()
    assert param_grads(tmp_path / "again.zarr", "a") == [grads_of(net(batches(1)[0]).square().mean(), net.a)] * 2


def test_each_micro_batch_records_its_own_gradient(tmp_path: Path) -> None:
    """With gradient accumulation .grad holds a sum; each backward step records the gradient of its
    own micro-batch, as torch.autograd.grad computes it apart."""
    record(tmp_path / "run.zarr", accumulated)
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    want = []
    for i, x in enumerate(batches(4)):
        grads = torch.autograd.grad(net(x).square().mean(), [net.a.weight, net.a.bias])
        want.append({"weight": raw(grads[0]), "bias": raw(grads[1])})
        net(x).square().mean().backward()  # the same steps as the recorded training
        if i % 2:
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert param_grads(tmp_path / "run.zarr", "a") == want


def test_gradients_before_clipping(tmp_path: Path) -> None:
    record(tmp_path / "run.zarr", clipped)
    torch.manual_seed(0)
    net = Net()
    x = batches(2)[0]
    (net(x).square().mean() * 100).backward()
    got = param_grads(tmp_path / "run.zarr", "b")[0]
    assert got == {"weight": raw(net.b.weight.grad), "bias": raw(net.b.bias.grad)}
    torch.nn.utils.clip_grad_norm_(net.parameters(), 1e-3)
    assert got["weight"] != raw(net.b.weight.grad)  # clipping did change .grad afterwards


def test_autograd_grad_a_shared_module_and_a_hook_that_changes_grad(tmp_path: Path) -> None:
    """torch.autograd.grad (.grad stays None), a module called twice (each backward step shows its
    call's own share of the pass's total), a post-accumulate-grad hook that changes .grad (recorded
    before it)."""
    record(tmp_path / "functional.zarr", functional)
    net = fresh()
    want = grads_of(net(batches(2)[0]).square().mean(), net.a)
    assert param_grads(tmp_path / "functional.zarr", "a")[0] == want

    record(tmp_path / "shared.zarr", shared_call)
    net = fresh()
    net.shape = "shared"
    want = grads_of(net(batches(1)[0]).sum(), net.a)
    shares = param_grads(tmp_path / "shared.zarr", "a")  # each call's own: together, the pass's total
    assert len(shares) == 2 and shares[0] != shares[1]
    for name in ("weight", "bias"):
        total = torch.frombuffer(bytearray(shares[0][name]), dtype=torch.float32) \
            + torch.frombuffer(bytearray(shares[1][name]), dtype=torch.float32)
        assert raw(total) == want[name]

    record(tmp_path / "hooked.zarr", stepped_in_backward)
    net = fresh()
    want = grads_of(net(batches(2)[0]).square().mean(), net.a)
    assert param_grads(tmp_path / "hooked.zarr", "a")[0] == want


def test_a_backward_pass_that_raises_keeps_the_gradients_that_came(tmp_path: Path) -> None:
    record(tmp_path / "run.zarr", raised_in_backward)
    rows = step_rows(tmp_path / "run.zarr")
    assert {(r["path"], t[1]) for r in rows for t in r["tensors"] if t[0] == "param_grad"} == {
        ("b", "weight"), ("b", "bias")}


def test_a_pass_that_reaches_parameters_only_through_an_auxiliary_loss(tmp_path: Path) -> None:
    """Gradients that reach a call's parameters other than through its outputs are its own: the
    first pass records a backward step with the auxiliary loss's gradient, the second the main's."""
    record(tmp_path / "run.zarr", auxiliary_first)
    net = fresh()
    out = net(batches(1)[0])
    (aux,) = torch.autograd.grad(net.a.aux, [net.a.weight], retain_graph=True)
    assert param_grads(tmp_path / "run.zarr", "a") == [{"weight": raw(aux)},
                                                       grads_of(out.square().mean(), net.a)]



@recorder.paper_step("Eq. 3")
class Residual(torch.nn.Module):
    """A physics-informed residual u_rr - 4 (u = net(r)): its derivatives by r do not depend on the last
    layer's bias, which only a boundary term outside the call reaches."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    def forward(self, r: torch.Tensor) -> torch.Tensor:
        u = self.net(r)
        (u_r,) = torch.autograd.grad(u, r, torch.ones_like(u), create_graph=True)
        (u_rr,) = torch.autograd.grad(u_r, r, torch.ones_like(u_r), create_graph=True)
        return u_rr - 4.0


@pytest.mark.parametrize("modules", [None, ["net.*"]], ids=["residual", "and-its-layers"])
def test_a_parameter_the_call_does_not_reach_gets_no_gradient_of_other_uses(tmp_path: Path,
                                                                              modules: list[str] | None) -> None:
    """A PINN's residual step sends its last bias no gradient; a boundary term through the same network,
    outside the step, does. The step's backward records no gradient for that bias (it recorded the
    boundary term's, which verify then called a mismatch at every iteration), its backward replays bit
    for bit, and the recorded shares of the bias add up to the .grad the pass left (the boundary term's
    was counted twice where the layers are steps too)."""
    torch.manual_seed(0)
    model = Residual()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with recorder.record(tmp_path / "run.zarr", model=model, optimizer=opt, modules=modules, mode="full"):
        for _ in range(2):
            r = torch.rand(6, 1, requires_grad=True)
            loss = model(r).square().mean() + (model.net(torch.ones(1, 1)) - 1).square().mean()
            loss.backward()
            left = model.net[2].bias.grad.clone()
            opt.step()
            opt.zero_grad()
    rec = replayer.open(tmp_path / "run.zarr")
    top = [s for s in rec.steps if s.phase == "backward" and s.name == "Residual"]
    assert len(top) == 2 and all("net.2.bias" not in {r.name for r in s.records if r.role == "param_grad"}
                                 for s in top)
    for step in top:
        assert replayer.replay(rec, step.index).match
    shares = [s.tensor(r.name, "param_grad") for s in rec.steps if s.phase == "backward" and s.iteration == 1
              for r in s.records if r.role == "param_grad" and r.name in ("net.2.bias", "bias")
              and s.module_path in ("", "net.2")]
    assert raw(sum(shares)) == raw(left) if modules else shares == []


@recorder.paper_step("Eq. 6", description="a gated projection of a weight given as an argument")
def gated(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w) * torch.sigmoid(x @ w.t()) + w.sum() * 0.1


def test_a_leaf_argument_records_its_calls_own_gradient_and_replays(tmp_path: Path) -> None:
    """A parameter given to a step directly is not tapped (the step gets it as it is, a leaf with its
    .grad); its grad input is the sum of its uses in the call's graph (three here), found as a module's
    own parameter grads are, without the gradient of a use outside the call (a decay term in the loss),
    bit for bit what autograd computes for the call alone, and a replay of the backward computes the same."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(5, 5))
    x = torch.randn(3, 5)
    with recorder.record(tmp_path / "run.zarr", mode="full"):
        out = gated(x, w)
        (out.square().mean() + w.square().sum() * 1e-2).backward()
    own, = torch.autograd.grad(gated.__wrapped__(x, w).square().mean(), [w])
    with replayer.open(tmp_path / "run.zarr") as rec:
        back = rec.steps.filter(name="gated", phase="backward")[0]
        assert [(r.role, r.name) for r in back.records if r.role != "grad_output"] == [("grad_input", "args.1")]
        assert raw(back.tensor("args.1")) == raw(own) != raw(w.grad)
        result = replayer.replay(rec, back.index)
        assert result.match and [d.name for d in result.outputs] == ["args.1"], [d.summary() for d in result.outputs]


@recorder.paper_step("Eq. 7", description="a module whose own weight a step inside it is given")
class GatedBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(5, 5))
        self.lin = torch.nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gated(self.lin(x), self.w) * self.w[0]


def test_a_leaf_given_to_an_inner_step_replays_in_the_outer_backward(tmp_path: Path) -> None:
    """A module's weight given to a step inside it (a leaf, untapped): a replay of the module's backward
    follows it through the inner step's graph as the recorder did, and the inner step's grad input for
    it compares bit for bit."""
    torch.manual_seed(0)
    block = GatedBlock()
    with recorder.record(tmp_path / "run.zarr", model=block, mode="full"):
        block(torch.randn(3, 5)).square().mean().backward()
    with replayer.open(tmp_path / "run.zarr") as rec:
        back = rec.steps.filter(name="GatedBlock", phase="backward")[0]
        result = replayer.replay(rec, back.index)
        assert result.match and len(result.inner) == 1, [d.summary() for d in result.outputs]
        inner = result.inner[0]
        assert inner.match and {d.name for d in inner.diffs} == {"output", "args.0", "args.1"}, \
            [d.summary() for d in inner.diffs]


@recorder.paper_step("Eq. 8", description="ReLU in place: returns its argument, changed")
def relu_in_place(x: torch.Tensor) -> torch.Tensor:
    return torch.relu_(x)


@recorder.paper_step("Eq. 9", description="a residual around an in-place ReLU; its scale used by the caller only")
class ScaledResidual(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(5, 5)
        self.scale = torch.nn.Parameter(torch.ones(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return relu_in_place(h) * 2 + h


def test_an_inner_step_changing_a_tensor_in_place_leaves_the_outer_walk_whole(tmp_path: Path) -> None:
    """An inner step changing the module's tensor in place: training is bitwise as unrecorded, and the
    node that gives the module's tensor the change's history is the recorder's, not a custom
    autograd.Function of the user's: the walk of the module's graph still sees all of it, so a parameter
    the call does not use (one its caller uses) gets no gradient recorded, and the module's backward
    replays."""
    def train(path: Path | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        block = ScaledResidual()
        with recorder.record(path, model=block, mode="full") if path is not None else torch.enable_grad():
            (block(torch.randn(3, 5)) * block.scale).sum().backward()
        return [p.grad for p in block.parameters()]

    for a, b in zip(train(None), train(tmp_path / "run.zarr"), strict=True):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    with replayer.open(tmp_path / "run.zarr") as rec:
        back = rec.steps.filter(name="ScaledResidual", phase="backward")[0]
        assert {r.name for r in back.records if r.role == "param_grad"} == {"lin.weight", "lin.bias"}
        result = replayer.replay(rec, back.index)
        assert result.match, [d.summary() for d in result.outputs]


@recorder.paper_step("Eq. 10", description="a functional MLP: its weights given in a dict, a list and a tuple")
def functional_mlp(x: torch.Tensor, params: dict[str, torch.Tensor], extra: list[torch.Tensor],
                   pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    h = torch.tanh(x @ params["w1"] + params["b1"])
    return (h @ extra[0]) * pair[0] + pair[1] + h.sum() * extra[0].mean()


def test_leaves_inside_containers_record_their_calls_own_gradients_and_replay(tmp_path: Path) -> None:
    """Parameters given to a step inside a dict, a list or a tuple (a functional forward, MAML's fast weights
    at their first step) are followed as top-level ones are: each gets a grad input, the sum of its uses in
    the call's graph, bit for bit what autograd computes for the call alone; the step gets the caller's
    tensors themselves; training is bitwise as unrecorded; a replay of the backward computes the same."""
    torch.manual_seed(0)
    made = {"w1": torch.randn(4, 6), "b1": torch.randn(6), "w2": torch.randn(6, 3), "s": torch.randn(3),
            "c": torch.randn(3)}
    x = torch.randn(5, 4)

    def train(path: Path | None) -> tuple[dict[str, torch.Tensor], list[Any]]:
        p = {k: torch.nn.Parameter(v.clone()) for k, v in made.items()}
        seen: list[Any] = []
        with recorder.record(path, mode="full") if path is not None else contextlib.nullcontext():
            params, extra, pair = {"w1": p["w1"], "b1": p["b1"]}, [p["w2"]], (p["s"], p["c"])
            out = functional_mlp(x, params, extra, pair)
            seen.extend([params["w1"] is p["w1"], extra[0] is p["w2"], pair[0] is p["s"]])
            (out.square().mean() + p["w1"].square().sum() * 1e-2).backward()
        return {k: v.grad for k, v in p.items()}, seen

    plain, _ = train(None)
    grads, seen = train(tmp_path / "run.zarr")
    assert all(seen)
    for k in made:
        assert raw(grads[k]) == raw(plain[k]), k
    p = {k: torch.nn.Parameter(v.clone()) for k, v in made.items()}
    args = (x, {"w1": p["w1"], "b1": p["b1"]}, [p["w2"]], (p["s"], p["c"]))
    names = {"args.1.w1": "w1", "args.1.b1": "b1", "args.2.0": "w2", "args.3.0": "s", "args.3.1": "c"}
    own = dict(zip(names.values(), torch.autograd.grad(functional_mlp.__wrapped__(*args).square().mean(),
                                                       [p[k] for k in names.values()])))
    with replayer.open(tmp_path / "run.zarr") as rec:
        back = rec.steps.filter(name="functional_mlp", phase="backward")[0]
        got = {r.name for r in back.records if r.role == "grad_input"}
        assert got == set(names), got
        for name, key in names.items():
            assert raw(back.tensor(name)) == raw(own[key]), name
        result = replayer.replay(rec, back.index)
        assert result.match and {d.name for d in result.outputs} == set(names), [d.summary() for d in result.outputs]


@recorder.paper_step("Eq. 11", description="a module handing its own weights to a functional step in containers")
class FunctionalBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.b1 = torch.nn.Parameter(torch.randn(4, 6)), torch.nn.Parameter(torch.randn(6))
        self.w2, self.s, self.c = (torch.nn.Parameter(torch.randn(6, 3)), torch.nn.Parameter(torch.randn(3)),
                                   torch.nn.Parameter(torch.randn(3)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return functional_mlp(x, {"w1": self.w1, "b1": self.b1}, [self.w2], (self.s, self.c)) * self.s


def test_leaves_inside_an_inner_steps_containers_replay_in_the_outer_backward(tmp_path: Path) -> None:
    """A module's weights given to a step inside it in a dict, a list and a tuple: a replay of the module's
    backward follows them through the inner step's graph as the recorder did, and the inner step's grad
    inputs for them compare bit for bit."""
    torch.manual_seed(0)
    block = FunctionalBlock()
    with recorder.record(tmp_path / "run.zarr", model=block, mode="full"):
        block(torch.randn(5, 4)).square().mean().backward()
    with replayer.open(tmp_path / "run.zarr") as rec:
        back = rec.steps.filter(name="FunctionalBlock", phase="backward")[0]
        result = replayer.replay(rec, back.index)
        assert result.match and len(result.inner) == 1, [d.summary() for d in result.outputs]
        inner = result.inner[0]
        assert inner.match and {d.name for d in inner.diffs} == {
            "output", "args.1.w1", "args.1.b1", "args.2.0", "args.3.0", "args.3.1"}, \
            [d.summary() for d in inner.diffs]


def _penalty(fc: torch.nn.Linear, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """An L2 penalty of the weight alone: a pass that reaches it by no call of the module."""
    return fc.weight.square().sum()


def _jvp(fc: torch.nn.Linear, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A directional derivative through another call of the module (under torch.func.jvp)."""
    _, tangent = torch.func.jvp(fc, (x,), (torch.ones_like(x),))
    return tangent.square().mean()


def _used(fc: torch.nn.Linear, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The penalty with the call's output in the loss too: the pass goes through the call's graph."""
    return y.sum() + fc.weight.square().sum()


def _train_with_a_metric(loss_of: Callable[..., torch.Tensor], path: Path | None) -> torch.nn.Linear:
    """Two iterations of a call of ``fc`` in grad mode whose output is a metric (argmax) or, for ``_used``,
    part of the loss, then a backward pass of ``loss_of``; recorded at ``path`` unless it is None."""
    torch.manual_seed(0)
    fc = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(fc.parameters(), lr=0.1)
    x = torch.randn(3, 4)
    accuracy = []
    context = recorder.record(path, model=torch.nn.ModuleDict({"fc": fc}), optimizer=opt, modules=["fc"],
                              mode="full") if path is not None else contextlib.nullcontext()
    with context:
        for _ in range(2):
            y = fc(x)
            accuracy.append(y.argmax(-1).eq(0).float().mean())
            loss_of(fc, x, y).backward()
            opt.step()
            opt.zero_grad()
    return fc


@pytest.mark.parametrize("loss_of", [_penalty, _jvp], ids=["l2-penalty", "jvp"])
def test_a_call_whose_output_gets_no_gradient_has_no_backward_step(tmp_path: Path,
                                                                   loss_of: Callable[..., torch.Tensor]) -> None:
    """A call whose output is only a metric, then a backward pass that reaches its parameters by other uses
    (an L2 penalty of the weight, a jvp of the module): the pass never went through the call's graph, which
    has no backward step (it had one holding the other pass's weight gradient), and training is bitwise the
    same as unrecorded."""
    fc = _train_with_a_metric(loss_of, tmp_path / "run.zarr")
    plain = _train_with_a_metric(loss_of, None)
    assert all(raw(a) == raw(b) for a, b in zip(fc.parameters(), plain.parameters()))
    rec = replayer.open(tmp_path / "run.zarr")
    assert [s.phase for s in rec.steps] == ["forward"] * (2 if loss_of is _penalty else 4)


def test_a_call_whose_output_the_pass_uses_records_its_own_share(tmp_path: Path) -> None:
    """With the call's output in the loss beside the penalty, its backward step holds its own share of the
    parameter gradients, as before."""
    _train_with_a_metric(_used, tmp_path / "run.zarr")
    torch.manual_seed(0)
    fc = torch.nn.Linear(4, 4)
    y = fc(torch.randn(3, 4))
    assert param_grads(tmp_path / "run.zarr", "fc")[0] == grads_of(y.sum(), fc)
