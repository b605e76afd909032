"""Paper steps called under torch.func transforms (vmap, grad, jvp; per-sample gradients): recorded
with the values the transform holds (a vmap's whole batch, with its batch dimensions), NaN found in
them, recording going on afterwards, and a vmapped step replayed under vmap again, bit for bit."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import types
import warnings

import pytest
import torch
from torch.func import functional_call, grad, jacrev, jvp, stack_module_state, vmap

import recorder
import replayer
from recorder import transforms
from recorder.errors import ReplayError
from recorder.store import layout
from replayer.bisect import describe
from tests.cli import ROOT, pdbg


@recorder.paper_step("Eq. 5", description="softmax of a row, and its norm")
def row_softmax(x: torch.Tensor, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.softmax(x / temperature, dim=-1), x.norm()


@recorder.paper_step("Eq. 6", description="projection, then Eq. 5")
class Projection(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return row_softmax(self.fc(x))[0]


def bits(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().view(-1).view(torch.uint8).numpy())


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    torch.manual_seed(0)
    layer = Projection()
    x = torch.randn(3, 5, 4)
    path = tmp_path_factory.mktemp("func") / "run.zarr"
    with recorder.record(path, mode="full") as run:
        vmap(row_softmax, in_dims=1)(x)                                         # 0
        vmap(layer)(x)                                                          # 1, 2 (Eq. 5 inside)
        grad(lambda t: row_softmax(t)[1])(x[0])                                 # 3
        jvp(lambda t: row_softmax(t)[0], (x[0],), (torch.ones(5, 4),))          # 4
        params = dict(layer.named_parameters())
        vmap(grad(lambda p, xi: functional_call(layer, p, (xi,)).sum()), in_dims=(None, 0))(params, x[0])  # 5, 6
        vmap(vmap(row_softmax))(x[0:2])                                         # 7
        row_softmax(x[0])                                                       # 8: plain, after them all
        vmap(row_softmax, in_dims=(0, None))(x[:2], 0.0)                        # 9: x / 0, born inside
    assert run.status == "complete" and run.failure is None
    return replayer.open(path), x, layer


def test_steps_under_transforms_hold_the_values_the_transform_holds(recorded):
    rec, x, layer = recorded
    steps = list(rec.steps)
    assert [(s.name, s.phase) for s in steps] == [
        ("row_softmax", "forward"), ("Projection", "forward"), ("row_softmax", "forward"),
        ("row_softmax", "forward"), ("row_softmax", "forward"), ("Projection", "forward"),
        ("row_softmax", "forward"), ("row_softmax", "forward"), ("row_softmax", "forward"),
        ("row_softmax", "forward")]
    for s in steps[:8]:
        assert transforms.NOTE in s.extra["notes"]
    assert "notes" not in steps[8].extra
    # vmap over dim 1: the whole batch as called, the batch dims of the arguments and results
    assert steps[0].extra["vmap"] == {"args.0": [1], "output.0": [0], "output.1": [0]}
    assert bits(steps[0].tensor("args.0")) == bits(x)
    assert bits(steps[0].tensor("output.0")) == bits(torch.softmax(x.movedim(1, 0), dim=-1))
    assert bits(steps[0].tensor("output.1")) == bits(torch.stack([x[:, i].norm() for i in range(5)]))
    # grad and jvp: the plain values
    assert "vmap" not in steps[3].extra and bits(steps[3].tensor("args.0")) == bits(x[0])
    assert bits(steps[4].tensor("output.0")) == bits(torch.softmax(x[0], dim=-1))
    # per-sample gradients: parameters unbatched, the input batched
    assert steps[6].extra["vmap"] == {"args.0": [0], "output.0": [0], "output.1": [0]}
    assert bits(steps[5].tensor("fc.weight")) == bits(layer.fc.weight.detach())
    assert steps[7].extra["vmap"]["args.0"] == [0, 0]
    assert bits(steps[8].tensor("output.0")) == bits(torch.softmax(x[0], dim=-1))


def test_nan_born_inside_vmap_is_found(recorded):
    rec, _, _ = recorded
    assert [s.status for s in rec.steps] == ["ok"] * 9 + ["nonfinite"]
    assert replayer.first_nonfinite(rec).step.index == 9


def test_a_vmapped_step_replays_under_vmap_bit_for_bit(recorded):
    rec, _, _ = recorded
    for index in (0, 1, 2, 3, 4, 5, 6, 8, 9):
        result = replayer.replay(rec, index)
        assert result.match, (index, result.outputs)
    # the steps inside a vmapped step: compared with their records, the whole batch (they were left out)
    for index in (1, 5):
        inner = replayer.replay(rec, index).inner
        assert [(s.step.index, s.match) for s in inner] == [(index + 1, True)]
    with pytest.raises(ReplayError, match="nested torch.func.vmap"):
        replayer.replay(rec, 7)


def test_replaying_a_step_of_nested_vmap_is_one_line_from_the_cli(recorded):
    rec, _, _ = recorded
    done = pdbg("replay", str(rec.path), "7", cwd=ROOT)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "nested torch.func.vmap" in done.stderr


@recorder.paper_step("Eq. 7", description="MLP with dropout")
class DropoutMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.drop, self.fc2 = torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


@recorder.paper_step("Eq. 8", description="one draw of noise for the whole batch")
def jitter(x: torch.Tensor) -> torch.Tensor:
    return x + 0.1 * torch.randn(x.shape)


def test_random_draws_under_vmap_replay_with_the_recorded_randomness(tmp_path):
    """DP-SGD per-sample gradients of a model with dropout need vmap(..., randomness="different"):
    a replay under vmap's default ("error") raised at the first draw, and every correct step was a
    MISMATCH. The randomness is recorded, and the replay draws as the call did, at each call."""
    torch.manual_seed(0)
    model = DropoutMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((functional_call(model, params, (x.unsqueeze(0),)).squeeze(0) - y) ** 2).mean()

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0), randomness="different")
    path = tmp_path / "dpsgd.zarr"
    with recorder.record(path, model=model, optimizer=opt, mode="full") as run:
        for _ in range(2):
            x, y = torch.randn(6, 4), torch.randn(6, 1)
            grads = per_sample({k: v.detach() for k, v in model.named_parameters()}, x, y)
            for k, p in model.named_parameters():
                p.grad = grads[k].mean(0)
            vmap(jitter, randomness="same")(x)
            opt.step()
            opt.zero_grad()
    assert run.failure is None
    rec = replayer.open(path)
    steps = list(rec.steps)
    assert [(s.name, s.iteration) for s in steps] == [("DropoutMLP", 0), ("jitter", 0), ("DropoutMLP", 1),
                                                        ("jitter", 1)]
    for s in steps:  # the first call and a later one (the batch's draws depend on the generator's state)
        result = replayer.replay(rec, s.index)
        assert result.match and result.exception is None, (s.index, result.exception, result.outputs)
    assert [s.extra["vmap_randomness"] for s in steps] == [["different"], ["same"]] * 2


def test_a_recording_that_lacks_the_randomness_says_so(tmp_path, monkeypatch):
    """A recording that does not hold the randomness (an older PaperDebugger, or a torch whose vmap
    does not tell) replays under vmap's default, and the replay that raises says why."""
    monkeypatch.setattr(transforms, "randomness", lambda: None)
    path = tmp_path / "old.zarr"
    with recorder.record(path, mode="full"):
        vmap(jitter, randomness="same")(torch.randn(3, 4))
    rec = replayer.open(path)
    assert "vmap_randomness" not in rec.step(0).extra
    result = replayer.replay(rec, 0)
    assert not result.match and "randomness error mode" in result.exception
    assert any("does not say with which randomness=" in w for w in result.warnings)


@recorder.paper_step("Eq. 9", description="energy of one sample")
def energy(v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.log1p((v * w).pow(2).sum())


@recorder.paper_step("Algorithm 3", description="mean energy over the batch")
def batch_energy(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return vmap(energy, in_dims=(0, None))(x, w).mean()


@pytest.fixture(scope="module")
def outer_over_vmap(tmp_path_factory):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(3))
    opt = torch.optim.SGD([w], lr=0.01)
    path = tmp_path_factory.mktemp("outer") / "outer.zarr"
    with recorder.record(path, optimizer=opt) as run:
        for _ in range(2):
            batch_energy(torch.randn(4, 3), w).backward()
            opt.step()
            opt.zero_grad()
    assert run.failure is None
    return path


def test_an_outer_step_that_vmaps_an_inner_step_replays_and_compares_it(outer_over_vmap):
    """The inner step's replayed outputs were batched tensors escaped from the vmap, and comparing
    them raised RuntimeError; the backward replay tapped them under vmap, which torch refuses. The
    inner step is compared as recorded, the whole batch, and the backward replays."""
    rec = replayer.open(outer_over_vmap)
    assert [(s.name, s.phase) for s in list(rec.steps)[:3]] == [("batch_energy", "forward"), ("energy", "forward"),
                                                                ("batch_energy", "backward")]
    result = replayer.replay(rec, 0)
    assert result.match and [(s.step.index, s.match) for s in result.inner] == [(1, True)]
    for nested in (True, False):
        assert replayer.replay(rec, 2, nested=nested).match
    done = pdbg("replay", str(outer_over_vmap), "0", cwd=ROOT)
    assert done.returncode == 0 and "inner steps: 1 of 1 match" in done.stdout, done.stderr


def test_the_tui_replays_an_outer_step_that_vmaps_an_inner_step(outer_over_vmap):
    from tui.app import PdbgApp

    async def main() -> str:
        app = PdbgApp(replayer.open(outer_over_vmap))
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause()
            await pilot.press("r")
            await app.workers.wait_for_complete()
            await pilot.pause()
            return str(app.panel_text)

    assert "replay of step 0: bitwise match" in asyncio.run(main())


@recorder.paper_step("Eq. 10", description="watched hidden layer, statistics of it")
class Watched(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 8)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> dict[str, torch.Tensor]:
        h = recorder.watch(torch.relu(self.fc(x)) * scale, "hidden", expected_shape=(8,))
        return {"max": h.max(), "mean": h.mean(), "pair": (h.min(), 2)}


def test_a_watch_a_keyword_and_a_dict_output_batched_by_vmap_replay(tmp_path):
    """A step under vmap with a watched intermediate, a batched keyword argument and a dict output was
    refused ("only positional tensor arguments and outputs can be batched"): it replays under vmap."""
    torch.manual_seed(0)
    layer = Watched()
    path = tmp_path / "watched.zarr"
    with recorder.record(path, mode="full"):
        vmap(lambda x, s: layer(x, scale=s)["max"])(torch.randn(3, 4), torch.arange(1.0, 4.0))
    rec = replayer.open(path)
    step = rec.step(0)
    assert set(step.extra["vmap"]) == {"args.0", "kwargs.scale", "hidden", "output.max", "output.mean",
                                       "output.pair.0"}
    result = replayer.replay(rec, 0)
    assert result.match, result.outputs
    assert sorted(d.name for d in result.outputs) == ["output.max", "output.mean", "output.pair.0"]


@recorder.paper_step("Eq. 11", description="ensemble member")
class Member(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.bn, self.fc2 = torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.bn(torch.sqrt(self.fc1(x) ** 2)))  # (a NaN gradient where fc1(x) is 0)


def test_a_stack_module_state_ensemble_replays_and_bisect_names_its_unrecorded_backward(tmp_path):
    """torch.func's model ensemble (stack_module_state, vmap over functional_call) batches the member's
    parameters and buffers: its replay was refused. It replays under vmap, the BatchNorm statistics the
    call updated compared too. Its backward (an ordinary loss.backward() after the vmap) is not
    recorded; the NaN it makes was blamed on the optimizer alone: bisect names the step."""
    torch.manual_seed(0)
    members = [Member() for _ in range(3)]
    params, buffers = stack_module_state(members)
    base = copy.deepcopy(members[0]).to("meta")
    opt = torch.optim.SGD(params.values(), lr=0.1)
    path = tmp_path / "ensemble.zarr"
    with recorder.record(path, optimizer=opt, mode="full") as run:
        for it in range(3):
            x = torch.randn(8, 4)
            if it == 1:
                x[0] = 0.0
                with torch.no_grad():
                    params["fc1.bias"].zero_()
            preds = vmap(lambda p, b, x: functional_call(base, (p, b), (x,)), in_dims=(0, 0, None))(params, buffers, x)
            preds.pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert run.failure is None
    rec = replayer.open(path)
    assert rec.step(0).extra["vmap"]["fc1.weight"] == [0] and rec.step(0).extra["vmap"]["bn.running_mean"] == [0]
    for index in (0, 1):
        result = replayer.replay(rec, index)
        assert result.match, (result.outputs, result.warnings)
        assert {"output", "after:bn.running_mean", "after:bn.running_var"} <= {d.name for d in result.outputs}
    origin = replayer.first_nonfinite(rec)
    assert origin.step is None and origin.entered.index == 2
    assert f"last finite in {describe(rec.step(1))}" in origin.cause and "recorded forward only" in origin.cause


_NAN_SAMPLE = torch.nn.Linear(3, 1)


@recorder.paper_step("Eq. 12", description="a per-sample loss, sqrt(r k) with k = 0 making its gradient NaN")
def nan_sample_loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, k: torch.Tensor
                    ) -> torch.Tensor:
    r = ((functional_call(_NAN_SAMPLE, params, (x.unsqueeze(0),)).squeeze(0) - y) ** 2).sum()
    return r + torch.sqrt(r * k)


def test_per_sample_gradients_that_turn_nan_are_named_as_the_likely_source(tmp_path):
    """Per-sample gradients (vmap(grad(loss)) over functional_call, the parameters given as an argument) NaN at
    iteration 1, finite forward: the parameters the update made NaN came into the next call as an input, and
    bisect said "from code outside every recorded step", no lead. It names the call that last saw them finite,
    recorded forward only under the transform, and its unrecorded gradients as the likely source."""
    torch.manual_seed(0)
    model = copy.deepcopy(_NAN_SAMPLE)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 3), torch.randn(4, 1)
    path = tmp_path / "per_sample.zarr"
    with recorder.record(path, optimizer=opt, mode="full"):
        for it in range(3):
            params = {k: v.detach() for k, v in model.named_parameters()}
            k = torch.tensor(0.0 if it == 1 else 1.0)
            g = vmap(grad(nan_sample_loss), in_dims=(None, 0, 0, None))(params, x, y, k)
            for n, p in model.named_parameters():
                p.grad = g[n].mean(0)
            opt.step()
            opt.zero_grad()
    rec = replayer.open(path)
    origin = replayer.first_nonfinite(rec)
    assert origin.step is None and origin.entered is not None and origin.entered.iteration == 2, origin.cause
    earlier = rec.steps.filter(name="nan_sample_loss", iteration=1)[0]
    assert f"it was last finite in {describe(earlier)}, which ran under a torch.func transform and is recorded " \
           "forward only" in origin.cause, origin.cause
    assert "those gradients, not recorded, are the likely source, through the optimizer update" in origin.cause


@recorder.paper_step("Eq. 7", description="a layer a JVP penalty also runs on dual tensors")
class DualLayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


def _jvp_training(record_to=None):
    """Three iterations of a loss with a JVP penalty taken with torch.autograd.forward_ad dual tensors
    through a recorded module; returns each iteration's loss and J v."""
    import torch.autograd.forward_ad as fwad

    torch.manual_seed(0)
    layer = DualLayer()
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    seen = []
    run = recorder.record(record_to, model=layer, optimizer=opt, mode="full") if record_to else None
    with run if run is not None else contextlib.nullcontext():
        for _ in range(3):
            x, v = torch.randn(4, 3), torch.randn(4, 3)
            loss = layer(x).pow(2).mean()
            with fwad.dual_level():
                jv = fwad.unpack_dual(layer(fwad.make_dual(x, v))).tangent
            loss = loss + 0.1 * jv.pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            seen += [loss.detach(), jv.detach()]
    return seen, run


def test_a_step_called_on_forward_ad_dual_tensors_is_recorded_and_its_primal_replays(tmp_path):
    """A recorded module called on torch.autograd.forward_ad dual tensors (a JVP penalty): training
    sees the same losses and tangents bit for bit, every step of every iteration is recorded (the
    recorder's tap once stopped the whole recording at the first such call), the dual call's forward
    replays bit for bit on the primal values, and its backward, whose gradient came through the
    tangent, is refused with the reason rather than compared."""
    plain, _ = _jvp_training()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        seen, run = _jvp_training(tmp_path / "run.zarr")
    assert run.status == "complete" and run.failure is None
    assert [bits(t) for t in seen] == [bits(t) for t in plain]
    rec = replayer.open(tmp_path / "run.zarr")
    steps = list(rec.steps)
    assert [(s.iteration, s.phase, s.call) for s in steps] == [
        (i, phase, call) for i in range(3) for phase, call in (("forward", 0), ("forward", 1), ("backward", 0),
                                                              ("backward", 1))]
    dual = [s for s in steps if s.phase == "forward" and s.call == 1]
    for s in dual:
        assert s.noted(layout.DUAL_NOTE) == {"args.0", "output"}
        result = replayer.replay(rec, s.index)
        assert result.match, result.outputs
    for s in steps:
        if s.phase == "backward" and s.call == 0:
            assert replayer.replay(rec, s.index).match
        elif s.phase == "backward":
            with pytest.raises(ReplayError, match="no grad outputs.*forward-AD dual tensors"):
                replayer.replay(rec, s.index)


with torch.random.fork_rng():
    torch.manual_seed(0)
    _PER_SAMPLE_MODEL = torch.nn.Sequential(Projection(), torch.nn.Linear(4, 1))  # the torch.func tutorial's global


@recorder.paper_step("Eq. 12", description="per-sample loss through the module-level model")
def per_sample_loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (functional_call(_PER_SAMPLE_MODEL, params, (x.unsqueeze(0),)).squeeze(0) - y).pow(2).sum()


def test_the_steps_inside_a_module_level_model_a_function_step_calls_are_compared(tmp_path):
    """A per-sample loss calling the model through a module-level name (``vmap(grad(loss))`` over
    ``functional_call(MODEL, ...)``) replayed bit for bit, yet its replay said MISMATCH: the steps inside the
    model were "recorded, but not called during the replay" (only the step's module root was watched), while
    verify said all matched. They are paired with their records and compared; the replay matches."""
    torch.manual_seed(0)
    x, y = torch.randn(4, 4), torch.randn(4, 1)
    params = {k: v.detach() for k, v in _PER_SAMPLE_MODEL.named_parameters()}
    with recorder.record(tmp_path / "run.zarr", model=_PER_SAMPLE_MODEL) as run:
        vmap(grad(per_sample_loss), in_dims=(None, 0, 0))(params, x, y)
        per_sample_loss(params, x[0], y[0])
    assert run.failure is None
    rec = replayer.open(tmp_path / "run.zarr")
    for selector in ("per_sample_loss#0", "per_sample_loss#1"):
        result = replayer.replay(rec, selector)
        assert result.match and result.compared, (selector, [s.reason for s in result.inner], result.warnings)
        assert [(s.step.module_path, s.step.name, s.match) for s in result.inner] == \
            [("0", "Projection", True), ("0", "row_softmax", True)], selector
    done = pdbg("replay", str(tmp_path / "run.zarr"), "per_sample_loss#0", cwd=ROOT)
    assert done.returncode == 0 and "inner steps: 2 of 2 match" in done.stdout, done.stdout + done.stderr


_HOLDER = types.SimpleNamespace(model=_PER_SAMPLE_MODEL)  # a model held by a plain object, not a module-level name


@recorder.paper_step("Eq. 12b", description="per-sample loss through a model a plain object holds")
def held_loss(x: torch.Tensor) -> torch.Tensor:
    return _HOLDER.model(x).pow(2).sum()


def test_the_steps_inside_a_model_a_replay_cannot_see_are_not_compared_not_a_divergence(tmp_path):
    """Where the model a function step calls is reached another way than a module-level name (an attribute of
    a plain object), the replay cannot watch the modules the recorded inner steps ran in: those are said to be
    not compared, and why, not "recorded, but not called" (a MISMATCH of a step whose outputs all match)."""
    with recorder.record(tmp_path / "run.zarr", model=_PER_SAMPLE_MODEL) as run:
        held_loss(torch.randn(4, 4))
    assert run.failure is None
    result = replayer.replay(replayer.open(tmp_path / "run.zarr"), "held_loss")
    assert result.match and result.inner == [], ([s.reason for s in result.inner], result.warnings)
    assert any(w.startswith("not compared: inner step 1 (Projection at 0) (and 1 more): a replay sees the steps "
                            "inside") for w in result.warnings), result.warnings


_JAC_STATE = {"k": 1.0}  # changed by the loop below: module-level data an inner step reads


@recorder.paper_step("Eq. 13", description="a block whose scale a module-level dict holds")
class _ScaledBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x) * _JAC_STATE["k"])


@recorder.paper_step("Eq. 14", description="input-Jacobian penalty")
class _JacPenalty(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(_ScaledBlock(), torch.nn.Linear(3, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return jacrev(lambda z: self.net(z).sum())(x).pow(2).mean()


def test_an_enclosing_steps_replay_names_its_inner_steps_module_level_data_not_torch_func(tmp_path):
    """A step computing ``jacrev`` over a network whose inner step reads a module-level dict training changes:
    its replay differed, and its only warning blamed ``from torch.func import jacrev`` as "not a class or
    function of the training code or of torch" (a likely cause), while the inner step's own replay named the
    dict. The enclosing step's replay names the inner step's module-level data, and not torch.func's jacrev."""
    torch.manual_seed(0)
    penalty = _JacPenalty()
    try:
        with recorder.record(tmp_path / "run.zarr", model=penalty) as run:
            for k in (1.0, 0.5):
                _JAC_STATE["k"] = k
                penalty(torch.randn(4, 3))
                run.next_iteration()
    finally:
        _JAC_STATE["k"] = 1.0
    rec = replayer.open(tmp_path / "run.zarr")
    assert replayer.replay(rec, "Eq. 14@iter=0").match
    result = replayer.replay(rec, "Eq. 14@iter=1")
    assert not result.match and [s.match for s in result.inner] == [False]
    inner = result.inner[0].step.index
    assert any(w.startswith(f"the code of the inner step {inner}: Eq. 13 (_ScaledBlock) reads the module-level "
                            "_JAC_STATE (dict), whose values are not recorded")
               for w in result.warnings), result.warnings
    assert not any("jacrev" in w for w in result.warnings), result.warnings
