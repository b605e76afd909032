"""Parameter gradients read from ``.grad`` at the end of the backward pass (capture.Session.
_grads_read_later) are the bytes a hook on each parameter records: every way training code can
reach, change or skip ``.grad`` during and after backward is recorded alike both ways, bit for bit,
and the gradients are the ones autograd computed for that backward pass."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import recorder
from recorder import capture
from recorder.store.reader import RunReader
from tests.recorder.readback import raw, step_rows


class Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        raise FloatingPointError("boom in backward")


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 6)
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


def plain(net: Net, opt: torch.optim.Optimizer) -> None:
    for x in batches(3):
        net(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


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


def shared_call(net: Net, opt: torch.optim.Optimizer) -> None:
    """One module called twice: each backward step gets the parameter's whole gradient."""
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


SCENARIOS: dict[str, Callable[[Net, torch.optim.Optimizer], None]] = {
    f.__name__: f for f in (plain, accumulated, forwards_then_backwards, clipped, functional,
                            twice_through_one_graph, shared_call, stepped_in_backward, raised_in_backward)}


def record(path: Path, scenario: Callable[[Net, torch.optim.Optimizer], None], hooks: bool,
           monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with monkeypatch.context() as m:
        if hooks:  # every parameter hooked, as before gradients were read at the pass's end
            m.setattr(capture.Session, "_grads_read_later", lambda self, frame: False)
        try:
            with recorder.record(path, model=net, modules=["a", "b"], mode="full"):
                scenario(net, opt)
        except FloatingPointError:
            assert scenario is raised_in_backward


@pytest.mark.parametrize("name", SCENARIOS)
def test_read_at_the_end_of_backward_as_hooks_record_them(name: str, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    read, hooked = tmp_path / "read.zarr", tmp_path / "hooked.zarr"
    record(read, SCENARIOS[name], False, monkeypatch)
    record(hooked, SCENARIOS[name], True, monkeypatch)
    rows = step_rows(read)
    assert rows == step_rows(hooked)
    grads = [t for r in rows if r["phase"] == 1 for t in r["tensors"] if t[0] == "param_grad"]
    if name == "raised_in_backward":  # b's backward ran, a's never did
        assert {(r["path"], t[1]) for r in rows for t in r["tensors"] if t[0] == "param_grad"} == {
            ("b", "weight"), ("b", "bias")}
    else:
        assert grads and all(len(t[4]) for t in grads)


def param_grads(path: Path, module: str) -> list[dict[str, bytes]]:
    """The param_grad bytes of each backward step of ``module``, in step order."""
    rank = RunReader(path).rank(0)
    out = []
    for i in range(len(rank)):
        col = lambda n: int(rank.column(f"steps/{n}")[i])  # noqa: E731
        if col("phase") == 1 and rank.doc(col("module_path")) == module:
            out.append({r.name: raw(rank.tensor(r)) for r in rank.tensor_records(i) if r.role == "param_grad"})
    return out


@pytest.mark.parametrize("hooks", [False, True], ids=["read", "hooked"])
def test_each_backward_pass_records_its_own_gradients(hooks: bool, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Two graphs built before either backward runs, and a second backward through a retained
    graph: each backward step records the gradient of its own pass, read at the pass's end or
    hooked (a hook is per tensor, not per graph: one that fires before its call's backward began
    is another graph's, and a second pass through one graph hooks the parameters again)."""
    record(tmp_path / "two.zarr", forwards_then_backwards, hooks, monkeypatch)
    record(tmp_path / "again.zarr", twice_through_one_graph, hooks, monkeypatch)
    torch.manual_seed(0)
    net = Net()
    x, y = batches(2)
    want = [torch.autograd.grad(loss, [net.a.weight, net.a.bias])
            for loss in (net(x).square().mean(), net(y).abs().mean())]
    assert param_grads(tmp_path / "two.zarr", "a") == [{"weight": raw(w), "bias": raw(b)} for w, b in want]
    torch.manual_seed(0)
    net = Net()
    w, b = torch.autograd.grad(net(batches(1)[0]).square().mean(), [net.a.weight, net.a.bias])
    assert param_grads(tmp_path / "again.zarr", "a") == [{"weight": raw(w), "bias": raw(b)}] * 2


def test_each_micro_batch_records_its_own_gradient(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With gradient accumulation .grad holds a sum; each backward step records the gradient of its
    own micro-batch, as torch.autograd.grad computes it apart."""
    record(tmp_path / "run.zarr", accumulated, False, monkeypatch)
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


def test_gradients_before_clipping(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    record(tmp_path / "run.zarr", clipped, False, monkeypatch)
    torch.manual_seed(0)
    net = Net()
    x = batches(2)[0]
    (net(x).square().mean() * 100).backward()
    got = param_grads(tmp_path / "run.zarr", "b")[0]
    assert got == {"weight": raw(net.b.weight.grad), "bias": raw(net.b.bias.grad)}
    torch.nn.utils.clip_grad_norm_(net.parameters(), 1e-3)
    assert got["weight"] != raw(net.b.weight.grad)  # clipping did change .grad afterwards
