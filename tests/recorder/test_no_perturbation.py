"""Recording never perturbs training: the recorder consumes no RNG and changes no setting, nor any
property of the user's tensors."""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import recorder
from recorder import snapshot
from recorder.errors import ReplayError
from recorder.store import layout
from tests.models import TinyGPT, batch, train_step

ROOT = Path(__file__).resolve().parents[2]


def _train(record_kwargs, path, iterations=4):
    torch.manual_seed(123)
    np.random.seed(123)
    random.seed(123)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, draws = [], []

    def loop():
        for i in range(iterations):
            losses.append(train_step(model, opt, i))
            # Code between steps that draws from every generator: any draw by the recorder shows here.
            draws.append((torch.rand(1).item(), np.random.rand(), random.random()))

    if record_kwargs is None:
        loop()
    else:
        with recorder.record(path, model=model, optimizer=opt, **record_kwargs) as run:
            loop()
        assert run.status == "complete" and run.failure is None
    return losses, draws, {n: p.detach().clone() for n, p in model.state_dict().items()}


@pytest.mark.parametrize("kwargs", [{"mode": "full"}, {"mode": "stats"}, {"mode": "full", "every": 2},
                                    {"mode": "flight", "keep": 2}, {"mode": "full", "modules": "**"},
                                    {"mode": "stats", "on_anomaly": "stop"}],
                         ids=["full", "stats", "full-every-2", "flight", "every-module", "on-anomaly-stop"])
def test_training_bitwise_identical_with_recording(tmp_path, kwargs):
    """Losses, final parameters and every RNG draw are bitwise identical with and without recording."""
    base_losses, base_draws, base_params = _train(None, None)
    settings_before = snapshot.settings()
    losses, draws, params = _train(kwargs, tmp_path / "run.zarr")
    assert snapshot.settings() == settings_before
    assert draws == base_draws
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(losses, base_losses))
    assert params.keys() == base_params.keys()
    for name in params:
        assert torch.equal(params[name].view(torch.uint8), base_params[name].view(torch.uint8)), name


def _global_module_hooks() -> dict[str, list[int]]:
    """torch's global module hook tables (hooks and their flags: with_kwargs, always_call), by name: a
    flag left behind keeps ``torch.nn.modules.module._has_any_global_hook()`` true after the hook is gone."""
    from torch.nn.modules import module as module_mod

    return {name: list(table) for name, table in vars(module_mod).items()
            if name.startswith("_global_") and name.endswith(("_hooks", "_with_kwargs", "_always_called"))
            and isinstance(table, dict)}


def test_global_hooks_removed_after_close(tmp_path):
    """After a recording closes, no module or optimizer hook of the recorder remains (nor any flag of
    one in torch's tables), and torch's functions it wraps while recording (GradScaler's, autograd's
    entry into its engine) are torch's own."""
    before = _global_module_hooks()
    functions = {name: getattr(torch.autograd, name) for name in ("backward", "grad", "_engine_run_backward")
                 if hasattr(torch.autograd, name)}
    scaler = (torch.amp.GradScaler.scale, torch.amp.GradScaler.step)
    model = TinyGPT()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with recorder.record(tmp_path / "run.zarr", model=model, optimizer=opt):
        model(batch(0)[0]).sum().backward()
    assert _global_module_hooks() == before
    assert {name: getattr(torch.autograd, name) for name in functions} == functions
    assert (torch.amp.GradScaler.scale, torch.amp.GradScaler.step) == scaler
    assert not opt._optimizer_step_post_hooks
    assert all(not p._backward_hooks for p in model.parameters())


def test_zero_edit_hooks_and_signal_handlers_removed_after_close(tmp_path):
    """modules=, optimizer="auto" and flight mode leave no global module or optimizer hook and no
    signal handler of theirs behind."""
    import signal

    from torch.optim import optimizer as optimizer_mod

    before = (_global_module_hooks(), len(optimizer_mod._global_optimizer_post_hooks), signal.getsignal(signal.SIGTERM))
    model = TinyGPT()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with recorder.record(tmp_path / "run.zarr", optimizer="auto", mode="flight", modules="**") as run:
        assert signal.getsignal(signal.SIGTERM) != before[2]
        train_step(model, opt, 0)
    assert run.iteration == 1
    assert (_global_module_hooks(), len(optimizer_mod._global_optimizer_post_hooks),
            signal.getsignal(signal.SIGTERM)) == before


@recorder.paper_step("Eq. 2", description="heads: a reshaped view of x, and x itself")
def to_heads(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.view(16, 2, 4), x


@recorder.paper_step("Eq. 3", description="q, k, v: disjoint parts of one projection")
def qkv(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return x.split([2, 2, 4], dim=-1)


def _heads_then_in_place(path, recorded: bool) -> tuple[float, torch.Tensor]:
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(16, 8)
    with recorder.record(path, model=lin, mode="full") if recorded else contextlib.nullcontext():
        heads, whole = to_heads(lin(x) * 1.0)
        heads.mul_(2.0)  # changes `whole` too, and autograd knows: its gradient doubles
        q, k, v = qkv(whole)
        loss = (q * k).sum() + v.pow(2).sum()
        loss.backward()
    return loss.item(), lin.weight.grad


def test_outputs_that_share_memory_are_left_as_they_are(tmp_path):
    """A step returning x and a view of it: an in-place change to one after the step reaches the
    other's gradient, as unrecorded (a tap would have made them two objects for autograd; they are
    not followed for gradients, and the recording says so, for that reason: its note gave the reason of a
    tensor inside an object, "taps reach tensors in tuples, lists, dicts ... only", of outputs that were in a
    tuple). Disjoint parts of one tensor (q, k, v) are still followed into the backward pass."""
    import replayer

    plain = _heads_then_in_place(None, recorded=False)
    path = tmp_path / "run.zarr"
    recorded = _heads_then_in_place(path, recorded=True)
    assert plain[0] == recorded[0] and torch.equal(plain[1], recorded[1])
    rec = replayer.open(path)
    heads, split = rec.step("Eq. 2#0"), rec.step("Eq. 3#0")
    assert not any(layout.UNFOLLOWED_NOTE in n for n in heads.extra["notes"]), heads.extra
    assert f"output.0, output.1 {layout.SHARED_OUTPUTS_NOTE}" in heads.extra["notes"], heads.extra
    backward = {s.forward: s for s in rec.steps if s.phase == "backward"}
    assert not [r for r in backward[heads.index].records if r.role == "grad_output"]
    assert sorted(r.name for r in backward[split.index].records if r.role == "grad_output") == [
        "output.0", "output.1", "output.2"]
    assert replayer.replay(rec, backward[split.index]).match


class _ActorCritic(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = torch.nn.Linear(4, 8)
        self.pi = torch.nn.Linear(8, 3)
        self.v = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.trunk(x))
        return self.pi(h), self.v(h)


def _actor_critic(path, value_only_first: bool = False):
    torch.manual_seed(0)
    model = _ActorCritic()
    actor = torch.optim.Adam([*model.trunk.parameters(), *model.pi.parameters()], lr=1e-2)
    critic = torch.optim.Adam(model.v.parameters(), lr=1e-2)
    with contextlib.ExitStack() as stack:
        run = None if path is None else stack.enter_context(recorder.record(path, model=model, optimizer=actor,
                                                                            modules="**", mode="full"))
        if value_only_first:  # a critic-only loss: no gradient reaches the policy head
            model(torch.randn(5, 4))[1].sum().backward()
            model.zero_grad()
        for _ in range(3):
            logits, v = model(torch.randn(5, 4))
            actor.zero_grad()
            critic.zero_grad()
            logits.logsumexp(-1).mean().backward(retain_graph=True)
            actor.step()  # changes pi.weight in place, which pi's backward saved
            v.pow(2).mean().backward()  # reaches only the value head and the trunk
            critic.step()
    assert run is None or (run.status == "complete" and run.failure is None), run and run.failure
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


def test_a_backward_from_one_output_runs_only_its_graph(tmp_path):
    """An actor-critic step returning (pi(h), v(h)), its two losses backpropagated one after the
    other with the actor's optimizer step between them: all of a step's outputs went through one tap,
    whose backward sent the critic's pass into the policy head's graph too, and training died
    ("one of the variables needed for gradient computation has been modified by an inplace
    operation"). A critic-only loss stopped the recording (a parameter hook called with no gradient).
    Each output has a tap of its own: training is as without recording, and every step replays."""
    import replayer

    plain = _actor_critic(None)
    recorded = _actor_critic(tmp_path / "run.zarr")
    assert all(torch.equal(plain[n].view(torch.uint8), recorded[n].view(torch.uint8)) for n in plain)
    rec = replayer.open(tmp_path / "run.zarr")
    backward = [s for s in rec.steps if s.phase == "backward" and s.module_path == ""]
    assert [sorted(r.name for r in s.records if r.role == "grad_output") for s in backward] == [
        ["output.0"], ["output.1"]] * 3  # the actor's pass, then the critic's
    assert all(replayer.replay(rec, s).match for s in rec.steps)
    _actor_critic(tmp_path / "value_first.zarr", value_only_first=True)
    assert replayer.open(tmp_path / "value_first.zarr").status == "complete"


def _qat(path, mode: str = "full") -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    from torch.ao.nn import qat as nnqat
    from torch.ao.quantization import get_default_qat_qconfig

    torch.manual_seed(0)
    model = torch.nn.Sequential(nnqat.Linear(4, 3, qconfig=get_default_qat_qconfig("x86")))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    with contextlib.ExitStack() as stack:
        run = None if path is None else stack.enter_context(recorder.record(path, model=model, optimizer=opt,
                                                                            modules=["0"], mode=mode))
        for _ in range(3):
            loss = model(torch.randn(2, 4)).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
    assert run is None or (run.status == "complete" and run.failure is None), run and run.failure
    return losses, {n: t.detach().clone() for n, t in model.state_dict().items()}


@pytest.mark.parametrize("mode", ["full", "stats", "flight"])
def test_a_qat_observer_resizes_its_buffers_as_unrecorded(tmp_path, mode):
    """A torch.ao per-channel QAT observer (the default qconfig of prepare_qat) resizes its empty
    min_val/max_val buffers in place at its first forward. The recorder had viewed them through
    Tensor.numpy(), which marks a storage non-resizable for good: the resize failed ("Trying to
    resize storage that is not resizable"), or left a buffer of 3 values on an empty storage, and the
    process died (SIGSEGV) at the end of the step. Training is now bitwise as unrecorded."""
    plain_losses, plain = _qat(None)
    losses, state = _qat(tmp_path / "run.zarr", mode)
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(losses, plain_losses))
    assert state.keys() == plain.keys() and "0.weight_fake_quant.activation_post_process.min_val" in state
    for name, t in state.items():
        assert t.shape == plain[name].shape and torch.equal(t.view(torch.uint8), plain[name].view(torch.uint8)), name
    assert state["0.weight_fake_quant.activation_post_process.min_val"].shape == (3,)


@recorder.paper_step("Eq. 4", description="a step given plain tensors")
def doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 2.0


def test_a_recorded_tensor_can_be_resized_afterwards(tmp_path):
    """A tensor recorded as a step's input (or its gradient, a buffer...) stays resizable in place:
    the recorder views its memory without Tensor.numpy(), which marked its storage non-resizable."""
    x, empty, grad_input = torch.arange(4.0), torch.zeros(0), torch.ones(3, requires_grad=True)
    with recorder.record(tmp_path / "run.zarr", mode="full") as run:
        doubled(x)
        doubled(empty)
        doubled(grad_input).sum().backward()
    assert run.status == "complete"
    x.resize_(10_000)
    empty.resize_(3)
    grad_input.detach().resize_(10_000)
    assert x.shape == (10_000,) and torch.equal(x[:4], torch.arange(4.0)) and empty.shape == (3,)


FREEING = """
import sys

import torch

import recorder


class Freeing(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.ones(3))

    def forward(self, x):
        out = x * self.b.sum()
        self.b.untyped_storage().resize_(0)  # freed after use, as FSDP frees a parameter's storage
        return out


@recorder.paper_step("Eq. 5", description="frees its input's storage")
def free_input(x):
    out = x * 2.0
    x.untyped_storage().resize_(0)
    return out


model = torch.nn.Sequential(Freeing())
with recorder.record(sys.argv[1], model=model, modules=["0"]) as run:
    for _ in range(2):
        model(torch.ones(2))
        model[0].b.untyped_storage().resize_(12)  # allocated again before its next call
        model[0].b.fill_(1.0)
        free_input(torch.ones(3))
print(run.status, run.failure)
"""


def test_a_tensor_whose_storage_was_freed_is_recorded_without_its_bytes(tmp_path):
    """A buffer or an input whose storage the step freed (resized to 0 bytes, its shape left as it
    was) crashed the process (SIGSEGV) when the recorder kept or compared its bytes at the step's
    end. The recording goes on: such a tensor is recorded as metadata, with a note saying why."""
    script = tmp_path / "freeing.py"
    script.write_text(FREEING)
    path = tmp_path / "run.zarr"
    res = subprocess.run([sys.executable, str(script), str(path)], capture_output=True, text=True, timeout=120,
                         check=False, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["complete", "None"]
    import replayer

    rec = replayer.open(path)
    step = rec.step("Eq. 5#0")
    [after] = [r for r in step.records if r.name == f"{layout.AFTER_PREFIX}args.0"]
    assert after.shape == (3,) and not after.has_payload
    assert any(n.startswith(f"{layout.AFTER_PREFIX}args.0: ") and "smaller than its shape" in n
               for n in step.extra.get("notes", [])), step.extra
    assert [r.shape for r in rec.step("Freeing#1").records if r.name == "b"] == [(3,)]


@recorder.paper_step("Eq. 1", description="a layer seen by op counters")
class _Counted(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.fc(x))


_LOGGED: list[str] = []


class _Logged(torch.Tensor):
    """A tensor subclass that logs every operation its __torch_function__ sees."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        _LOGGED.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


class _Strict(torch.Tensor):
    """A units tensor that refuses every operation whose units it cannot derive."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") not in ("mul", "__mul__", "__get__", "detach", "sum", "backward"):
            raise TypeError(f"no units for {getattr(func, '__name__', func)}")
        return super().__torch_function__(func, types, args, kwargs or {})


@recorder.paper_step("Eq. 2", description="scale a distance")
def _scale(d, s):
    return d * s


def test_torch_modes_and_tensor_subclasses_see_only_the_training_codes_operations(tmp_path):
    """A TorchFunctionMode and a TorchDispatchMode that count operations around a recorded training step
    (as FLOP counters do), and a tensor subclass whose __torch_function__ logs what it sees, count what
    they count unrecorded: the recorder's own reads of the tensors are not theirs (a function mode once
    saw 176 calls an iteration instead of 4, a dispatch mode 39 ops instead of 17, the subclass 64
    operations a call instead of 2). A subclass that refuses operations it does not know no longer
    refuses the recorder's reads: its values are recorded."""
    import collections

    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    import replayer

    class CountF(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.seen = collections.Counter()

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.seen[getattr(func, "__name__", str(func))] += 1
            return func(*args, **(kwargs or {}))

    class CountD(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen[str(func)] += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    layer = _Counted()
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)

    def iteration():
        f, d = CountF(), CountD()
        with f, d:
            layer(torch.randn(3, 4)).sum().backward()
        del _LOGGED[:]
        layer(torch.randn(3, 4).as_subclass(_Logged))
        opt.step()
        opt.zero_grad()
        return f.seen, d.seen, collections.Counter(_LOGGED)

    plain = iteration()
    with recorder.record(tmp_path / "run.zarr", model=layer, optimizer=opt, mode="full") as run:
        recorded = [iteration() for _ in range(2)]
        y = _scale(torch.ones(3, requires_grad=True).as_subclass(_Strict), 2.0)
        y.sum().backward()
    assert run.status == "complete"
    assert recorded == [plain, plain]
    step = list(replayer.open(tmp_path / "run.zarr").steps)[-2]
    assert step.name == "_scale" and all(r.has_payload for r in step.records), step.extra


SAW: list[tuple[bool, bool, str, bool]] = []


@recorder.paper_step("Eq. 3", description="the classic hand-written SGD update, given a parameter")
def _sgd_update(p, lr, caller):
    SAW.append((p.is_leaf, p.grad is not None, type(p).__name__, p is caller))
    p.data.add_(p.grad.data, alpha=-lr)


@recorder.paper_step("Eq. 3", description="an update skipping parameters without a gradient, as torch's do")
def _guarded_update(p, lr):
    if p.grad is not None:
        p.data.add_(p.grad, alpha=-lr)


def _hand_written_training(path):
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)
    x = torch.randn(8, 4)
    with recorder.record(path, mode="full") if path is not None else contextlib.nullcontext():
        for _ in range(3):
            lin.zero_grad()
            lin(x).pow(2).mean().backward()
            for p in lin.parameters():  # grad mode on, as in a training loop
                _sgd_update(p, 0.1, p)
                _guarded_update(p, 0.05)
    return [p.detach().clone() for p in lin.parameters()]


def test_a_parameter_given_directly_to_a_step_is_the_callers_tensor(tmp_path):
    """A parameter passed to a step as a top-level argument with grad mode on (a hand-written update,
    ``for p in model.parameters(): update(p, lr)``) is the caller's tensor inside the step: a leaf, a
    Parameter, with its .grad. A tap once gave the step an alias without .grad: the update
    ``p.data.add_(p.grad.data, ...)`` raised while recording, and one guarded by ``if p.grad is not None``
    skipped every update. Training is bitwise the same, and the update steps replay bit for bit."""
    import replayer

    SAW.clear()
    plain = _hand_written_training(None)
    assert SAW and all(saw == (True, True, "Parameter", True) for saw in SAW)
    SAW.clear()
    recorded = _hand_written_training(tmp_path / "run.zarr")
    assert SAW and all(saw == (True, True, "Parameter", True) for saw in SAW), SAW
    for a, b in zip(plain, recorded, strict=True):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    with replayer.open(tmp_path / "run.zarr") as rec:
        updates = [s for s in rec.steps if s.name in ("_sgd_update", "_guarded_update")]
        assert len(updates) == 12 and all(s.phase == "forward" for s in updates)
        for step in updates:
            assert {"args.0", "args.0:grad"} <= {r.name for r in step.records if r.role == "input"}
            assert "after:args.0" in {r.name for r in step.records if r.role == "output"}
            result = replayer.replay(rec, step.index)
            assert result.match, (step.index, [d.summary() for d in result.outputs])


@recorder.paper_step("Eq. 4", description="ReLU in place: returns its argument, changed")
def _relu_in_place(x):
    return torch.relu_(x)


@recorder.paper_step("Eq. 4", description="a scale in place, then another result")
def _scaled_then_other(x):
    x.mul_(2.0)
    return x * 1.5


@recorder.paper_step("Eq. 4", description="several in-place operations on the argument")
def _clamped_scaled_relu(x):
    x.clamp_(min=-0.5)
    x.mul_(3.0)
    return x.relu_()


@recorder.paper_step("Eq. 4", description="a gate given by keyword, squashed in place")
def _gate_in_place(x, *, gate):
    gate.sigmoid_()
    return x * gate


_IN_PLACE = {"relu_": _relu_in_place, "other": _scaled_then_other, "several": _clamped_scaled_relu,
             "view": _relu_in_place, "slice": _relu_in_place}


def _in_place_training(path, mode: str, kind: str) -> tuple[list[torch.Tensor], list[bool]]:
    """Two iterations of a linear layer whose output a step (or an ``nn.ReLU(inplace=True)`` picked with
    ``modules=``) changes in place, the caller's tensor used after the step too."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"lin": torch.nn.Linear(8, 8), "act": torch.nn.ReLU(inplace=True)})
    x = torch.randn(4, 8)
    picked = {"modules": ["act"]} if kind == "module" else {}
    same = []
    with recorder.record(path, model=model, mode=mode, **picked) if path is not None else contextlib.nullcontext():
        for _ in range(2):
            model.zero_grad()
            h = model["lin"](x)
            given = h.t() if kind == "view" else h[:, 1:6] if kind == "slice" else h
            if kind == "module":
                y = model["act"](given)
            elif kind == "keyword":
                y = _gate_in_place(h * 1.0, gate=given)
            else:
                y = _IN_PLACE[kind](given)
            same.append(y is given)
            ((y * 2).sum() + (given * 3).sum() + (h * h).sum() + (y * y).sum()).backward()
    return [p.grad.clone() for p in model["lin"].parameters()], same


@pytest.mark.parametrize("mode", ["full", "flight", "stats"])
@pytest.mark.parametrize("kind", ["relu_", "other", "several", "keyword", "view", "slice", "module"])
def test_a_step_changing_its_argument_in_place_trains_as_unrecorded(tmp_path, mode, kind):
    """A step (or a module picked with ``modules=``) that changes its argument in place got a tap's alias of
    it, and the change went into autograd's history of the alias alone: the caller's tensor kept its history
    from before, and the gradient of its later uses skipped the change (the linear layer's weight gradient
    off by whole units). Gradients are now bitwise as unrecorded, and a step returning its argument returns
    the caller's tensor, as unrecorded."""
    plain, plain_same = _in_place_training(None, mode, kind)
    grads, same = _in_place_training(tmp_path / "run.zarr", mode, kind)
    assert same == plain_same
    for a, b in zip(plain, grads, strict=True):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_a_step_changing_its_argument_in_place_records_what_a_replay_computes(tmp_path):
    """A step returning its argument changed in place records the gradient of every later use of the
    caller's tensor as its grad output, and its grad input from it: its backward replays bit for bit.
    One that returns something else records no grad input for that argument (the gradient of the
    caller's later uses passes its in-place operation, which a replay of its backward does not see)
    and says so in a note; its forward replays, and a replay of its backward says why it has nothing
    to compare."""
    import replayer

    path = tmp_path / "run.zarr"
    _in_place_training(path, "full", "relu_")
    with replayer.open(path) as rec:
        back = rec.steps.filter(name="_relu_in_place", phase="backward")
        assert len(back) == 2
        for step in back:
            assert {(r.role, r.name) for r in step.records if r.role.startswith("grad")} == {
                ("grad_output", "output"), ("grad_input", "args.0")}
        for step in rec.steps:
            result = replayer.replay(rec, step.index)
            assert result.match, (step.index, step.phase, [d.summary() for d in result.outputs])
    path = tmp_path / "other.zarr"
    _in_place_training(path, "full", "other")
    with replayer.open(path) as rec:
        fwd = rec.steps.filter(name="_scaled_then_other", phase="forward")[0]
        assert f"args.0: {layout.CHANGED_ARGUMENT_NOTE}" in fwd.extra["notes"]
        back = rec.steps.filter(name="_scaled_then_other", phase="backward")[0]
        assert [r.name for r in back.records if r.role == "grad_input"] == []
        assert [r.name for r in back.records if r.role == "grad_output"] == ["output"]
        assert replayer.replay(rec, fwd.index).match
        with pytest.raises(ReplayError, match=r"changed its arguments args\.0 in place without returning them"):
            replayer.replay(rec, back.index)


@recorder.paper_step("Eq. 5", description="a gate: the first half, rectified in place, times the second")
def _half_gate(a, b):
    a.relu_()
    return a * b


def _refused(path, kind: str) -> str:
    torch.manual_seed(0)
    w = torch.randn(4, 6, requires_grad=True)
    with pytest.raises(RuntimeError) as raised:
        with recorder.record(path, mode="full") if path is not None else contextlib.nullcontext():
            if kind == "leaf":
                _relu_in_place(w)
            elif kind == "view of a leaf":
                _relu_in_place(w[:, :2])
            else:
                _half_gate(*(w * 1).split(3, dim=1))
    return str(raised.value)


@pytest.mark.parametrize("kind", ["leaf", "view of a leaf", "split"])
def test_an_in_place_change_autograd_refuses_raises_as_unrecorded(tmp_path, kind):
    """An in-place change that autograd refuses unrecorded (to a leaf that requires grad, a view of one,
    one of the views ``split`` returns) raises the same error while recording: the alias a tap gives
    the step would have let it pass, the caller's tensor then changed without autograd knowing."""
    plain = _refused(None, kind)
    recorded = _refused(tmp_path / "run.zarr", kind)
    assert recorded.split(" is a view and ")[0] == plain.split(" is a view and ")[0]
    assert recorded.endswith(plain[-60:])


@recorder.paper_step("Eq. 5", description="a stop of the gradient: the argument detached in place")
def _stop_gradient(x):
    x.detach_()
    return x * 2


def _detaching_training(path, view: bool = False):
    torch.manual_seed(0)
    a, b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)
    losses = []
    with recorder.record(path, mode="full") if path is not None else contextlib.nullcontext():
        for _ in range(2):
            h = a(torch.randn(4, 8))
            t = _stop_gradient(h[:, :4] if view else h)
            loss = (b(h).pow(2) + t.sum(-1, keepdim=True)).mean()  # the caller uses h again after the step
            loss.backward()
            losses.append(loss.detach())
            with torch.no_grad():
                for p in (*a.parameters(), *b.parameters()):
                    if p.grad is not None:  # (a's get none: the stop detached h)
                        p.sub_(0.1 * p.grad)
                    p.grad = None
    return h.requires_grad, losses, [p.detach().clone() for p in (*a.parameters(), *b.parameters())]


def test_a_step_detaching_its_argument_in_place_trains_as_unrecorded(tmp_path):
    """A step that detaches its argument in place (x.detach_()) detaches the caller's tensor unrecorded: the
    caller's later use of it sends no gradient on. Recorded, it detached its tap's alias alone, the caller's
    tensor kept its history, and the layers before it were trained by that use: other losses and weights. The
    caller's tensor is detached as the call left its alias; a view, which refuses, raises as unrecorded."""
    plain = _detaching_training(None)
    recorded = _detaching_training(tmp_path / "run.zarr")
    assert plain[0] is recorded[0] is False
    assert all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(plain[1] + plain[2],
                                                                                    recorded[1] + recorded[2]))
    with pytest.raises(RuntimeError, match="Can't detach views in-place") as unrecorded:
        _detaching_training(None, view=True)
    with pytest.raises(RuntimeError, match="Can't detach views in-place") as raised:
        _detaching_training(tmp_path / "view.zarr", view=True)
    assert str(raised.value) == str(unrecorded.value)


@recorder.paper_step("Eq. 5", description="attention weights that keep their input's gradient for a saliency map")
def _salient_attention(h):
    h.retain_grad()
    return torch.softmax(h, -1) * h


def test_a_step_keeping_its_arguments_gradient_keeps_the_callers(tmp_path):
    """A step that calls retain_grad() on its argument: the caller reads that tensor's .grad after the
    backward (a saliency map). Recorded, the step's tap alias kept it, and the caller's tensor had None;
    it has the gradient, bit for bit as unrecorded (with a use outside the step too, the last bits may differ:
    a hooked argument's uses are summed first, as the README says)."""
    grads = []
    for path in (None, tmp_path / "run.zarr"):
        torch.manual_seed(0)
        a = torch.nn.Linear(8, 8)
        with recorder.record(path, mode="full") if path is not None else contextlib.nullcontext():
            h = a(torch.randn(4, 8))
            _salient_attention(h).sum().backward()
        assert h.retains_grad and h.grad is not None
        grads.append(h.grad)
    assert torch.equal(grads[0].view(torch.int32), grads[1].view(torch.int32))


@recorder.paper_step("Eq. 6", description="attention of a sequence with itself")
def _attention(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) / 4, -1) @ v


_GATES: dict[str, torch.Tensor] = {}


@recorder.paper_step("Eq. 6", description="its argument used twice: scaled, and scaled then squashed")
def _used_twice(x):
    return x * _GATES["w1"] + (x * _GATES["w2"]).sin()


@recorder.paper_step("Eq. 6", description="a residual around self-attention: the argument used four times")
def _residual_attention(x):
    return x + _attention(x, x, x)


@recorder.paper_step("Eq. 6", description="two results of its argument, each using it twice")
def _two_results(x):
    return x * _GATES["w1"] + (x * _GATES["w2"]).sin(), x.exp() * x


@recorder.paper_step("Eq. 6", description="its argument used, rectified in place, and used again")
def _used_then_rectified(x):
    y = (x * 2.0).exp()
    x.relu_()
    return y + x * _GATES["w2"]


@recorder.paper_step("Eq. 6", description="its argument used nine times: a polynomial and its gates")
def _many_uses(x):
    return x * _GATES["w1"] + (x * _GATES["w2"]).sin() + x.exp() * x + x.cos() + x.tanh() * x * x + x.square()


def _twice_and_after(h):
    t = h.tanh()
    return _used_twice(t) + t


def _checkpointed(x, reentrant: bool):
    from torch.utils.checkpoint import checkpoint

    return checkpoint(_twice_and_after, x, use_reentrant=reentrant)


_USES = {"attention": lambda h: h + _attention(h, h, h), "twice": lambda h: _used_twice(h) + h.cos(),
         "nested": lambda h: _residual_attention(h) * h, "before": lambda h: (h * 3).exp() + _used_twice(h),
         "many": lambda h: _many_uses(h) + h.sin(),
         "one-result-used": lambda h: _two_results(h)[0] * h, "in-place": lambda h: _used_then_rectified(h) * h,
         "reentrant": lambda h: _checkpointed(h, True) * h, "non-reentrant": lambda h: _checkpointed(h, False) * h}


def _several_uses(path, kind: str, dtype: torch.dtype | None, mode: str = "full", penalty: bool = False
                  ) -> list[torch.Tensor]:
    """Two iterations of a linear layer whose output a step uses several times, the caller using it
    outside the step too; the parameter grads (a gradient penalty's: ``penalty``)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 16)
    _GATES.update(w1=torch.randn(16, requires_grad=True), w2=torch.randn(16, requires_grad=True))
    x = torch.randn(4, 8, 16)
    with recorder.record(path, model=lin, mode=mode) if path is not None else contextlib.nullcontext():
        for _ in range(2):
            lin.zero_grad()
            with torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext():
                h = lin(x)
                loss = _USES[kind](h).float().square().mean()
            if penalty:
                (grad,) = torch.autograd.grad(loss, h, create_graph=True)
                loss = loss + grad.float().square().sum()
            loss.backward()
    return [t.grad.clone() for t in (*lin.parameters(), *_GATES.values()) if t.grad is not None]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["float32", "bf16-autocast"])
@pytest.mark.parametrize("kind", ["attention", "twice", "nested", "many", "one-result-used", "in-place", "before"])
def test_a_step_using_its_argument_several_times_trains_as_unrecorded(tmp_path, kind, dtype):
    """A step that uses its argument several times (self-attention given h as query, key and value, a
    step computing ``x * w1 + (x * w2).sin()``), whose caller uses that tensor outside it too: autograd
    adds each use's gradient into the caller's tensor's gradient one by one, and a tap passed on their
    sum, so the parameter grads upstream differed in their last bits (bf16 autocast: by up to 1e-3).
    Each use's gradient now passes on apart, and the grads are bitwise as unrecorded: a step inside
    another (an attention inside a residual step) too, and one whose results the caller uses one of.
    A step using it nine times (a polynomial: up to 16 uses pass on apart, 4 before schema 1.22) too.
    So they stay where a sum was exact before too: a caller that used the tensor before the step only
    (the step's uses come first), a step that changes it in place between its uses (the caller's later
    uses go through that change, into the step)."""
    plain = _several_uses(None, kind, dtype)
    grads = _several_uses(tmp_path / "run.zarr", kind, dtype)
    for a, b in zip(plain, grads, strict=True):
        assert torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("kind", ["reentrant", "non-reentrant"])
def test_a_checkpointed_step_using_its_argument_twice_trains_as_unrecorded(tmp_path, kind):
    """The same inside activation checkpointing: reentrant checkpointing taps the step where its
    recomputation runs, in the backward pass, and passes its uses on apart there."""
    plain = _several_uses(None, kind, None)
    grads = _several_uses(tmp_path / "run.zarr", kind, None, mode="stats")
    for a, b in zip(plain, grads, strict=True):
        assert torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("kind", ["attention", "nested"])
def test_a_gradient_penalty_through_a_step_using_its_argument_several_times_is_as_unrecorded(tmp_path, kind):
    """A first pass taken with create_graph=True (a gradient penalty) sends each use's gradient on with
    its own graph, and the second pass through those graphs gives bitwise the grads it does unrecorded."""
    plain = _several_uses(None, kind, None, penalty=True)
    grads = _several_uses(tmp_path / "run.zarr", kind, None, mode="stats", penalty=True)
    for a, b in zip(plain, grads, strict=True):
        assert torch.equal(_bits(a), _bits(b))


def test_a_step_using_its_argument_several_times_records_what_a_replay_computes(tmp_path):
    """The uses passed on apart, a step's grad input is still their sum, added as autograd adds them:
    every step, the residual around the attention and the attention inside it, replays bit for bit."""
    import replayer

    path = tmp_path / "run.zarr"
    _several_uses(path, "nested", torch.bfloat16)
    with replayer.open(path) as rec:
        back = rec.steps.filter(name="_residual_attention", phase="backward")
        assert len(back) == 2 and all("args.0" in {r.name for r in s.records if r.role == "grad_input"} for s in back)
        for step in rec.steps:
            result = replayer.replay(rec, step.index)
            assert result.match, (step.index, step.phase, [d.summary() for d in result.outputs])


_KEPT: list[torch.Tensor] = []


@recorder.paper_step("Eq. 7", description="its argument used twice, and a term of it kept for the caller")
def _keeps_a_term(x):
    out = x * _GATES["w1"] + x * _GATES["w2"]
    _KEPT.append(x.exp())
    return out


def test_a_use_outside_the_steps_outputs_still_sends_its_gradient(tmp_path):
    """A use of the argument the walk from the step's outputs does not find (a term the step keeps for
    its caller) still sends its gradient on, with the uses passed on apart, in the order autograd adds them:
    the grads are bitwise as unrecorded."""
    def train(path):
        torch.manual_seed(0)
        lin = torch.nn.Linear(8, 8)
        _GATES.update(w1=torch.randn(8, requires_grad=True), w2=torch.randn(8, requires_grad=True))
        with recorder.record(path, model=lin, mode="stats") if path is not None else contextlib.nullcontext():
            h = lin(torch.randn(4, 8))
            (_keeps_a_term(h) + _KEPT.pop() + h).square().sum().backward()
        return [t.grad.clone() for t in (*lin.parameters(), *_GATES.values())]

    plain = train(None)
    for a, b in zip(plain, train(tmp_path / "run.zarr"), strict=True):
        assert torch.equal(_bits(a), _bits(b))


@recorder.paper_step("Eq. 8", description="its argument used twice, once under a square root")
def _rooted(x):
    return x * 2.0 + x.sqrt()


def test_anomaly_mode_names_the_operation_of_a_use_passed_on_apart(tmp_path):
    """Anomaly mode checks each node's results for NaN after its hooks: the node of a use whose gradient
    is NaN is the one it names, as unrecorded (not the recorder's tap, with the use passed on apart)."""
    def raised(path):
        x = torch.tensor([-1.0, 4.0], requires_grad=True)
        with recorder.record(path, mode="stats") if path is not None else contextlib.nullcontext(), \
                torch.autograd.set_detect_anomaly(True), pytest.raises(RuntimeError) as caught:
            (_rooted(x * 1.0) + x).sum().backward()
        return str(caught.value)

    assert "SqrtBackward0" in raised(None)
    assert "SqrtBackward0" in raised(tmp_path / "run.zarr")


_SEEN_BY_HOOK: list[torch.Tensor] = []


def _halved(g):
    _SEEN_BY_HOOK.append(g)
    return g * 0.5


@recorder.paper_step("Eq. 9", description="its argument used twice, its gradient halved by a hook")
def _hooked_twice(x):
    x.register_hook(_halved)
    return x * _GATES["w1"] + (x * _GATES["w2"]).sin()


def test_a_gradient_hook_on_an_argument_used_twice_sees_and_changes_their_sum(tmp_path):
    """A step that hooks its argument's gradient (``x.register_hook``) gets the hook called with the sum
    of its uses, and what the hook returns goes on: its uses are not passed on apart, which would leave
    the hook nothing to see."""
    def train(path):
        torch.manual_seed(0)
        lin = torch.nn.Linear(8, 8)
        _GATES.update(w1=torch.randn(8, requires_grad=True), w2=torch.randn(8, requires_grad=True))
        _SEEN_BY_HOOK.clear()
        with recorder.record(path, model=lin, mode="stats") if path is not None else contextlib.nullcontext():
            _hooked_twice(lin(torch.randn(4, 8))).square().sum().backward()
        assert len(_SEEN_BY_HOOK) == 1
        return [t.grad.clone() for t in (*lin.parameters(), *_GATES.values())]

    for a, b in zip(train(None), train(tmp_path / "run.zarr"), strict=True):
        assert torch.equal(_bits(a), _bits(b))


class _Box:
    """A plain object holding a tensor: no tap reaches into it."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


@recorder.paper_step("Eq. 10", description="its argument doubled, and two reductions of it returned in plain objects")
def _boxed_results(h):
    return h * 2, _Box(h.sum()), _Box(h.mean())


_KEPT_ARGUMENTS: list[torch.Tensor] = []


@recorder.paper_step("Eq. 10", description="its argument kept for the loss to read later")
def _keep_argument(h):
    _KEPT_ARGUMENTS.append(h)


def _uses_after_return(path, kind: str) -> tuple[list[torch.Tensor], ...]:
    """Three iterations of a linear layer whose output steps use in ways the walk from their outputs does not
    find, the caller using it too; the losses, the last iteration's grads and the parameters."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    losses = []
    with recorder.record(path, model=lin, optimizer=opt, mode="stats") if path is not None \
            else contextlib.nullcontext():
        for _ in range(3):
            opt.zero_grad()
            _KEPT_ARGUMENTS.clear()
            h = lin(torch.randn(4, 8))
            if kind in ("kept", "both"):
                _keep_argument(h)
            loss = h.square().sum()
            if kind in ("boxed", "both"):
                doubled, total, mean = _boxed_results(h)
                loss = doubled.square().sum() + total.t * 3 + mean.t.exp()
            for kept in _KEPT_ARGUMENTS:
                loss = loss + kept.sin().sum()
            loss = loss + h.cos().sum()
            loss.backward()
            losses.append(loss.detach().clone())
            grads = [p.grad.clone() for p in lin.parameters()]
            opt.step()
    return losses, grads, [p.detach().clone() for p in lin.parameters()]


@pytest.mark.parametrize("kind", ["kept", "boxed", "both"])
def test_uses_made_after_a_step_returned_train_as_unrecorded(tmp_path, kind):
    """A step's argument used after the step returned (kept in a list the loss reads), or inside the step
    for results returned in plain objects no tap reaches: those uses' gradients went to the argument's tap,
    which passed them on, summed, only when it ran, among the contributions the caller's own uses of the
    tensor had sent meanwhile, so the weight grads differed in their last bits. The pass now adds every use's
    contribution in the order the uses run, as unrecorded: losses, grads and parameters are bitwise the same."""
    torch.set_num_threads(1)  # (one thread: a difference is the order of the sums, not of the threads')
    try:
        plain = _uses_after_return(None, kind)
        recorded = _uses_after_return(tmp_path / "run.zarr", kind)
    finally:
        torch.set_num_threads(_THREADS)
    for plain_part, recorded_part in zip(plain, recorded, strict=True):
        for a, b in zip(plain_part, recorded_part, strict=True):
            assert torch.equal(_bits(a), _bits(b))


_THREADS = torch.get_num_threads()


@recorder.paper_step("Eq. 11", description="a step around one that keeps its argument, read after it returned")
def _around_a_kept_argument(h):
    t = h * 1.5
    _keep_argument(t)
    out = t.square()
    for kept in _KEPT_ARGUMENTS:
        out = out + kept.sin()
    return out + t.cos()


def test_a_step_around_a_use_after_return_records_what_a_replay_computes(tmp_path):
    """An outer step whose inner step's argument it uses after the inner one returned: its grad input holds
    the sum autograd makes of each use in turn, and a replay of its backward adds them so too, bit for bit."""
    import replayer

    path = tmp_path / "run.zarr"
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 16)
    with recorder.record(path, model=lin, mode="full"):
        _KEPT_ARGUMENTS.clear()
        h = lin(torch.randn(8, 16))
        (_around_a_kept_argument(h) * h).square().sum().backward()
    _KEPT_ARGUMENTS.clear()
    with replayer.open(path) as rec:
        back = rec.steps.filter(name="_around_a_kept_argument", phase="backward")
        assert len(back) == 1 and "args.0" in {r.name for r in back[0].records if r.role == "grad_input"}
        result = replayer.replay(rec, back[0].index)
        assert result.match, [d.summary() for d in result.outputs]
