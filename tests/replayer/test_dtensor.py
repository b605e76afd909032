"""Tensors that hold no memory of their own (wrapper subclasses) under torch.distributed: a DTensor
(tensor parallelism's sharded weights, FSDP2's sharded parameters) is recorded as this rank's local
shard, with its placements, mesh and whole shape; an AsyncCollectiveTensor (a tensor-parallel layer's
all-reduced output) as its values. Before, the recorder read bytes at their null data pointer: garbage
values (false NaN findings) or a crash. A replay of a step whose tensors were DTensors is refused in one
line naming why; the steps inside it given plain tensors replay bit for bit.

These run in one process, in a gloo process group of one rank (an in-memory store: no network);
tests/replayer/test_distributed.py runs two ranks."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import recorder
import replayer
from recorder.errors import ReplayError
from tests.cli import pdbg_here

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="this torch build has no gloo backend")


@recorder.paper_step("Eq. 4", description="scaled tanh")
def squash(h: torch.Tensor) -> torch.Tensor:
    return torch.tanh(h) * 2.0


@recorder.paper_step("Alg. 2", step=1, description="projection")
class Proj(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return squash(self.fc(x))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


@contextlib.contextmanager
def one_rank() -> Iterator[None]:
    """A gloo process group of this process alone, destroyed after."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_tensor_parallel_layer_records_its_local_shard_and_is_refused_in_one_line(tmp_path: Path) -> None:
    """A Colwise-parallel layer's DTensor weight is recorded as its local shard's bits, with its placement;
    its step's replay is refused naming the DTensor, the step inside it replays bit for bit."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    out = tmp_path / "run.zarr"
    with one_rank():
        model = Proj()
        parallelize_module(model, init_device_mesh("cpu", (1,)), {"fc": ColwiseParallel()})
        weight = model.fc.weight.to_local().detach().clone()
        x = torch.randn(3, 8)
        with recorder.record(out, model=model):
            model(x).sum().backward()
    rec = replayer.open(out)
    step = rec.step("Proj")
    assert torch.equal(bits(step.tensor("fc.weight")), bits(weight))  # its bits, not what lay at a null pointer
    assert step.extra["dtensors"]["fc.weight"] == {"placements": ["Shard(dim=0)"], "mesh": [1], "mesh_dims": None,
                                                   "coordinate": [0], "shape": [6, 8]}
    assert all(r.stats["nan"] == 0 for s in rec.steps for r in rec.step(s.index).tensors())
    with pytest.raises(ReplayError) as caught:
        replayer.replay(rec, step.index)
    assert "fc.weight was a DTensor" in str(caught.value) and "Shard(dim=0)" in str(caught.value)
    assert "to_local()" in str(caught.value)
    res = pdbg_here("replay", str(out), "Proj", cwd=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.count("\n") == 1 and "cannot be replayed: its parameter fc.weight was a DTensor" in res.stderr
    assert replayer.replay(rec, "squash").match  # given a plain tensor (the layer's local output)
    bundled = pdbg_here("bundle", str(out), "Proj:backward", "-o", str(tmp_path / "proj.pdbg"), cwd=tmp_path)
    assert bundled.returncode == 2 and "Traceback" not in bundled.stderr and bundled.stderr.count("\n") == 1
    assert "cannot be bundled: its parameter fc.weight was a DTensor" in bundled.stderr
    assert not (tmp_path / "proj.pdbg").exists()


def test_an_async_collective_tensor_is_recorded_as_its_values(tmp_path: Path) -> None:
    """A step given an AsyncCollectiveTensor (a row-wise layer's output) records its values bit for bit and
    replays them; the recording does not change what the step computed."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    x = torch.randn(4, 8)
    expected = squash(x.clone())
    out = tmp_path / "run.zarr"
    with recorder.record(out):
        got = squash(AsyncCollectiveTensor(x.clone()))
    assert torch.equal(bits(got), bits(expected))
    rec = replayer.open(out)
    step = rec.step("squash")
    assert torch.equal(bits(step.tensor("args.0")), bits(x))
    assert "subclasses" not in step.extra  # nothing to make again: it only waited for its values
    res = replayer.replay(rec, step.index)
    assert res.match and not res.warnings


class Wrapped(torch.Tensor):
    """A wrapper subclass of another kind: its values are its inner tensor's, through __torch_dispatch__."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> Wrapped:
        out = torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)
        out.inner = inner
        return out

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        def unwrap(v: object) -> object:
            return v.inner if isinstance(v, Wrapped) else v

        out = func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in (kwargs or {}).items()})
        return Wrapped(out) if func is torch.ops.aten.detach.default else out  # (as a DTensor's detach is one)


def test_a_wrapper_subclass_of_another_kind_is_recorded_as_metadata_with_a_note(tmp_path: Path) -> None:
    """A wrapper subclass the recorder does not know holds no memory to read: its record keeps its metadata and
    a note says why (never the bytes at its null data pointer), and the step's result is recorded as usual."""
    x = torch.randn(4, 8)
    out = tmp_path / "run.zarr"
    with pytest.warns(recorder.RecorderWarning, match="could not capture args.0"), recorder.record(out):
        squash(Wrapped(x))
    step = replayer.open(out).step("squash")
    arg = step.record("args.0")
    assert not arg.has_payload and arg.shape == (4, 8)
    assert any("wraps other tensors" in n for n in step.extra["notes"])
    assert torch.equal(bits(step.tensor("output")), bits(squash(x)))


def test_a_module_step_under_fully_shard_replays_bit_for_bit(tmp_path: Path) -> None:
    """FSDP2's fully_shard gives a module a class made at run time (FSDPProj(FSDPModule, Proj)), which no replay
    could import ("_fsdp_init has no FSDPProj now (renamed or removed since the recording?)"): the skeleton names the
    module's own class, and its forward and backward steps, given the gathered parameters, replay bit for bit."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    out = tmp_path / "run.zarr"
    with one_rank():
        torch.manual_seed(0)
        model = nn.Sequential(Proj(), nn.Linear(6, 2))
        mesh = init_device_mesh("cpu", (1,))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        assert type(model[0]).__name__ == "FSDPProj"
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with recorder.record(out, model=model, optimizer=opt):
            for _ in range(2):
                opt.zero_grad()
                model(torch.randn(3, 8)).pow(2).mean().backward()
                opt.step()
    rec = replayer.open(out)
    proj = [s.index for s in rec.steps if rec.step(s.index).name == "Proj"]
    assert len(proj) == 4  # forward and backward, two iterations
    for index in proj:
        res = replayer.replay(rec, index)
        assert res.match, (index, res.warnings)


def _class_as_before_1_31(module: nn.Module) -> type:
    """skeleton.own_class as the recorder had it before schema 1.31: blind to fully_shard's class."""
    from torch.nn.utils import parametrize

    cls = type(module)
    if cls.__module__ == parametrize.__name__ and "parametrizations" in module._modules and cls.__bases__:
        return cls.__bases__[0]
    return cls


class Unmarked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_a_step_recorded_under_fully_shard_before_1_31_replays_or_says_to_record_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A recording made before schema 1.31 named a module under fully_shard by the class FSDP2 made at run time
    (torch.distributed.fsdp._fully_shard._fsdp_init:FSDPProj), and every replay of its steps was refused with the
    misleading '_fsdp_init has no FSDPProj now (renamed or removed since the recording?)'. The class it wrapped is
    found again (the class its constructor was recorded with, or torch.nn's), and its steps replay bit for bit;
    where which class it wrapped is not known, the replay says the step was recorded under fully_shard before 1.31
    and to record again."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from recorder import skeleton

    out = tmp_path / "run.zarr"
    with one_rank():
        torch.manual_seed(0)
        model = nn.Sequential(Proj(), nn.Linear(6, 6), Unmarked())
        mesh = init_device_mesh("cpu", (1,))
        for layer in (model[0], model[1], model[2], model):
            fully_shard(layer, mesh=mesh)
        with monkeypatch.context() as patch:
            patch.setattr(skeleton, "own_class", _class_as_before_1_31)
            with recorder.record(out, model=model, modules=["1", "2"]):
                model(torch.randn(3, 8)).pow(2).mean().backward()
    rec = replayer.open(out)
    classes = {rec.step(s.index).name: rec.step(s.index)._doc("module")["class"] for s in rec.steps
               if rec.step(s.index).phase == "forward" and rec.step(s.index)._doc("module")}
    assert classes == {"Proj": "torch.distributed.fsdp._fully_shard._fsdp_init:FSDPProj",
                       "FSDPLinear": "torch.distributed.fsdp._fully_shard._fsdp_init:FSDPLinear",
                       "FSDPUnmarked": "torch.distributed.fsdp._fully_shard._fsdp_init:FSDPUnmarked"}
    found = [s.index for s in rec.steps if rec.step(s.index).name in ("Proj", "FSDPLinear")]
    assert len(found) == 4  # forward and backward of each
    for index in found:
        res = replayer.replay(rec, index)
        assert res.match, (index, res.warnings)
    for index in [s.index for s in rec.steps if rec.step(s.index).name == "FSDPUnmarked"]:
        with pytest.raises(ReplayError, match=r"^FSDPUnmarked is the class FSDP2's fully_shard .* before schema "
                                              r"1\.31 .*record the run again") as err:
            replayer.replay(rec, index)
        assert "renamed or removed" not in str(err.value) and "\n" not in str(err.value)


def test_the_module_of_a_step_under_fully_shard_holds_no_state_named_per_process(tmp_path: Path) -> None:
    """fully_shard keeps its state on the module under keys with a new uuid in every process
    (``__composable_api_state_key_<uuid>``): recorded in the skeleton, they made pdbg bisect --against name
    'attribute __composable_api_state_key_...: ... in this run, not set in the other' as a cause of every
    divergence between two runs. They are not the module's state, and not recorded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    out = tmp_path / "run.zarr"
    with one_rank():
        model = nn.Sequential(Proj())
        fully_shard(model[0], mesh=init_device_mesh("cpu", (1,)))
        assert [k for k in vars(model[0]) if k.startswith("__composable_api_state_key")]
        with recorder.record(out, model=model):
            model(torch.randn(3, 8))
    skeleton = replayer.open(out).step("Proj")._doc("module")
    assert skeleton["class"].endswith(":Proj")
    assert not [k for k in {**skeleton["attrs"], **skeleton["unrecorded"]} if "composable_api" in k]


GAIN = [1.0]  # read by Gained's forward: what two runs below differ by, outside the step's inputs


@recorder.paper_step("Alg. 2", step=2, description="projection, gained")
class Gained(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * GAIN[0]


def test_two_runs_parting_at_a_dtensor_step_name_the_other_ranks_as_a_cause(tmp_path: Path) -> None:
    """Where two runs part at a step that computed on DTensors with the same inputs and parameters, the other
    ranks' shards its collectives took in are named as a possible cause (before: only 'nothing recorded explains
    it (nondeterministic kernels, ...)', while a NaN made on another rank of a tensor-parallel run came in so)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    runs = []
    for gain in (1.0, 3.0):
        GAIN[0] = gain
        out = tmp_path / f"run{gain}.zarr"
        with one_rank():
            torch.manual_seed(0)
            model = Gained()
            parallelize_module(model, init_device_mesh("cpu", (1,)), {"fc": ColwiseParallel()})
            with recorder.record(out, model=model):
                model(torch.ones(2, 8))
        runs.append(out)
    GAIN[0] = 1.0
    found = replayer.first_divergence(replayer.open(runs[0]), replayer.open(runs[1]))
    assert found is not None and found.step.name == "Gained"
    assert "same inputs and parameters" in found.cause
    assert "took it from another rank: it computed on DTensors" in found.cause


def test_parameters_parting_outside_the_steps_of_a_run_of_several_ranks_name_what_other_ranks_sent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two runs of two ranks whose rank 0 parts where its parameters came out of the update otherwise: the cause
    named its optimizer, its settings or its initialisation, never the gradients the other ranks sent through
    DDP's all-reduce or FSDP's reduce-scatter, outside every step. (The ranks are recorded one after the other in
    this process, each told its rank as torchrun tells it.)"""
    runs = []
    for nudge in (0.0, 1e-3):
        out = tmp_path / f"run{nudge}.zarr"
        for rank in (0, 1):
            monkeypatch.setenv("RANK", str(rank))
            monkeypatch.setenv("WORLD_SIZE", "2")
            torch.manual_seed(0)
            model = Proj()
            with recorder.record(out, model=model):
                for _ in range(2):
                    model(torch.ones(2, 8))
                    with torch.no_grad():  # outside every step: as a gradient another rank sent would
                        model.fc.bias.add_(nudge)
        runs.append(out)
    a, b = replayer.open(runs[0]), replayer.open(runs[1])
    assert a.ranks == [0, 1]
    found = replayer.first_divergence(a, b)
    assert found is not None and found.step.name == "Proj" and found.step.call == 1  # (its second call)
    assert "changed outside the recorded steps" in found.cause
    assert "or by what the other ranks sent: the gradients DistributedDataParallel or FSDP reduce" in found.cause


def test_a_module_under_fully_shard_recorded_by_modules_is_named_by_its_own_class(tmp_path: Path) -> None:
    """A module that modules= selects under fully_shard is the step of its own class (Linear, not the FSDPLinear
    made at run time), and replays bit for bit."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    out = tmp_path / "run.zarr"
    with one_rank():
        model = nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 2))
        mesh = init_device_mesh("cpu", (1,))
        fully_shard(model[2], mesh=mesh)
        fully_shard(model, mesh=mesh)
        with recorder.record(out, model=model, modules=["2"]):
            for _ in range(2):
                model(torch.randn(3, 8)).sum().backward()
    rec = replayer.open(out)
    assert {rec.step(s.index).name for s in rec.steps} == {"Linear"}
    assert all(replayer.replay(rec, s.index).match for s in rec.steps)


def test_a_nan_made_in_a_dtensor_step_may_have_come_from_another_rank(tmp_path: Path) -> None:
    """A step that computed on DTensors and made NaN from inputs finite on its rank is said to have maybe taken
    it from another rank (its collectives took in their shards, unrecorded), not plainly 'from finite inputs':
    under tensor parallelism a NaN made on rank 1 comes out of the all-reduce of every rank's row-wise layer."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    out = tmp_path / "run.zarr"
    GAIN[0] = float("nan")
    try:
        with one_rank():
            model = Gained()
            parallelize_module(model, init_device_mesh("cpu", (1,)), {"fc": ColwiseParallel()})
            with recorder.record(out, model=model):
                model(torch.ones(2, 8))
    finally:
        GAIN[0] = 1.0
    found = replayer.first_nonfinite(replayer.open(out))
    assert found is not None and found.step.name == "Gained"
    assert "from inputs that were finite on this rank, but it computed on DTensors" in found.cause, found.cause
    assert "the NaN may have come from another rank" in found.cause


def test_the_step_pane_says_a_dtensor_record_is_a_local_shard(tmp_path: Path) -> None:
    """A DTensor record holds this rank's local shard, its shape and statistics the shard's: the TUI's step pane
    showed its shape with no word of it (only the step's extra["dtensors"] said so). Its tensor line says
    "6×8 shard", a line under the table "fc.weight: local shard of 6×8 (Shard(dim=0))", and so does the
    inspector's title; a plain tensor's line is as before."""
    import asyncio

    from textual.widgets import Static

    from tui import views
    from tui.app import Inspector, PdbgApp, StepPane

    out = tmp_path / "run.zarr"
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    with one_rank():
        model = Gained()
        parallelize_module(model, init_device_mesh("cpu", (1,)), {"fc": ColwiseParallel()})
        with recorder.record(out, model=model):
            model(torch.ones(2, 8))
    view = views.step_view(replayer.open(out).step(0))
    assert {t.name: t.shape for t in view.tensors} == {"args.0": "2×8", "fc.weight": "6×8 shard",
                                                       "fc.bias": "6 shard", "output": "2×6"}
    assert view.shards == ["fc.weight: local shard of 6×8 (Shard(dim=0))", "fc.bias: local shard of 6 (Shard(dim=0))"]

    async def main() -> None:
        app = PdbgApp(replayer.open(out))
        async with app.run_test(size=(160, 36)) as pilot:
            await pilot.pause()
            pane = app.query_one(StepPane)
            drawn = [pane.render_line(y).text for y in range(pane.size.height)]
            assert any("fc.weight" in line and "6×8 shard" in line for line in drawn), drawn
            said = " ".join(" ".join(drawn).split())
            assert "local shards of DTensors, their shape and statistics the shard's: fc.weight: local shard of " \
                   "6×8 (Shard(dim=0)); fc.bias: local shard of 6 (Shard(dim=0))" in said, said
            app.save_screenshot(str(tmp_path / "shard.svg"))
            pane.selected = next(i for i, t in enumerate(pane.view.tensors) if t.name == "fc.weight")
            await app.run_action("inspect")
            await pilot.pause()
            assert isinstance(app.screen, Inspector)
            assert "param fc.weight · 6×8 local shard of 6×8 (Shard(dim=0)) float32" in \
                str(app.screen.query_one("#page", Static).render())

    asyncio.run(main())
    assert (tmp_path / "shard.svg").stat().st_size > 0
