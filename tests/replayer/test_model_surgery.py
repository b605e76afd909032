"""Models that change while they train: lazy modules that take their shapes at their first call,
an optimizer made anew when training resumes from a checkpoint, a module reached under two names.
Each records whole, and its steps replay bit for bit."""

from __future__ import annotations

import contextlib
import json
import shutil
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import recorder
import replayer
from recorder.store import layout
from tests.cli import pdbg, pdbg_here, python


def test_lazy_modules_record_their_first_call_and_replay_it(tmp_path: Path) -> None:
    """nn.LazyLinear's parameters are uninitialized until its first call: recording stopped there
    ("Attempted to use an uninitialized parameter") and training went on unrecorded. A module a glob
    selects is captured after its own forward pre-hooks, lazy initialisation among them: its first call
    is recorded with the parameters that made (the nn.Linear its forward ran as), and replays bit for
    bit, its backward too, and so does everything after; verify counts every step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(16), nn.ReLU(), nn.LazyLinear(4), nn.LazyBatchNorm1d())
    path = tmp_path / "run.zarr"
    with warnings.catch_warnings():
        warnings.simplefilter("error", recorder.RecorderWarning)
        with recorder.record(path, model=model, modules="*", optimizer="auto", mode="full"):
            opt = None
            for _ in range(2):  # the first batch initializes the parameters (and takes their gradients)
                F.cross_entropy(model(torch.randn(8, 10)), torch.randint(0, 4, (8,))).backward()
                opt = opt or torch.optim.SGD(model.parameters(), lr=0.05)
                opt.step()
                opt.zero_grad()
    rec = replayer.open(path)
    assert rec.status == "complete"
    first = rec.step("0@iter=0#0")
    assert first.name == "Linear" and first.uninitialized == frozenset()
    assert {r.name for r in first.records if r.role == "param"} == {"weight", "bias"}
    for i in range(len(rec)):
        res = replayer.replay(rec, i)
        assert res.match, (i, str(res), res.warnings)
        assert not any("could not be recorded" in w or "_infer_parameters" in w for w in res.warnings), res.warnings
    out = pdbg_here("verify", str(path), cwd=tmp_path)
    assert out.returncode == 0 and f"{len(rec)} of {len(rec)} steps replayed bit for bit" in out.stdout, out.stdout


@recorder.paper_step("Eq. 3")
class LazyProj(nn.LazyLinear):
    """A paper step that takes its input size at its first call."""


def _lazy_step_training(path: Path | None) -> tuple[nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(LazyProj(4), nn.ReLU())
    losses = []
    with recorder.record(path, model=model, mode="full", optimizer="auto") if path is not None \
            else contextlib.nullcontext():
        opt = None
        for _ in range(3):
            loss = F.cross_entropy(model(torch.randn(8, 10)), torch.randint(0, 4, (8,)))
            loss.backward()
            opt = opt or torch.optim.SGD(model.parameters(), lr=0.05)
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
    return model, [*losses, *(p.detach().clone() for p in model.parameters())]


def test_a_decorated_lazy_module_stays_its_step_after_its_first_call(tmp_path: Path) -> None:
    """A paper_step subclass of nn.LazyLinear became nn.Linear at its first call (torch's cls_to_become),
    and its later calls were no step: it stays its class, an nn.Linear still, every call is its step, and
    the first call and a later one replay bit for bit, forward and backward; training is unchanged."""
    plain_model, plain = _lazy_step_training(None)
    path = tmp_path / "run.zarr"
    model, recorded = _lazy_step_training(path)
    assert type(model[0]) is LazyProj and type(plain_model[0]) is LazyProj and isinstance(model[0], nn.Linear)
    for a, b in zip(plain, recorded, strict=True):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    rec = replayer.open(path)
    assert [(s.name, s.phase, s.iteration) for s in rec.steps] == [
        (name, phase, i) for i in range(3) for name, phase in (("LazyProj", "forward"), ("LazyProj", "backward"))]
    for step in rec.steps:
        res = replayer.replay(rec, step.index)
        assert res.match and res.outputs and all(d.match for d in res.outputs), (step.index, str(res), res.warnings)
        assert not any("could not be recorded" in w or "_infer_parameters" in w for w in res.warnings), res.warnings


def test_an_edit_of_a_parameter_the_lazy_call_itself_made_says_so(tmp_path: Path) -> None:
    """A lazy module called as the outermost module is captured before its lazy initialisation (its first call,
    in the global pre-hook): its parameters are recorded as uninitialized, and its replay makes them again from
    the recorded RNG, bit for bit. An edit of one at that call answered "matched nothing that ran during the
    replay", then NO CHANGE, though the edit names a record of the step. It says the call itself made the
    parameter (lazy initialisation), and names the later call the edit belongs at, where it does change the
    output."""
    torch.manual_seed(0)
    model = nn.LazyLinear(4)
    path = tmp_path / "run.zarr"
    with recorder.record(path, modules=["**"], mode="full") as run:
        for _ in range(2):
            model(torch.randn(3, 5))
            run.next_iteration()
    rec = replayer.open(path)
    first = rec.step(0)
    assert first.uninitialized == {"weight", "bias"} and layout.UNINITIALIZED_NOTE in first.extra["notes"][0]
    res = replayer.replay(rec, first.index)
    assert res.match and not any("_infer_parameters" in w for w in res.warnings), res.warnings
    res = replayer.replay(rec, first.index, edit={"weight": "x * 0"})
    later = [s for s in rec.steps if s.index > first.index and s.phase == "forward"][0]
    assert res.warnings == [
        "weight: it did not exist when this call began: the call itself made it (lazy initialisation: a lazy module "
        f"such as nn.LazyLinear makes its parameters at its first call), so there was nothing to edit; the edit "
        f"belongs at a later call, {later.selector}"], res.warnings
    assert rec.step(later.selector).index == later.index
    assert not replayer.replay(rec, later.selector, edit={"weight": "x * 0"}).match


PARAMETRIZED = '''
import sys
import torch
from torch import nn
from torch.nn.utils import parametrize
import recorder


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.s = nn.Parameter(torch.tensor(2.0))

    def forward(self, w):
        return self.s * w / w.norm()


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))
parametrize.register_parametrization(model[2], "weight", Scaled())
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with recorder.record(sys.argv[1], model=model, modules="*", optimizer=opt, mode="full"):
    for _ in range(2):
        model(torch.randn(4, 6)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
'''


def test_a_bundle_of_a_torch_layer_carries_the_script_and_not_torch(tmp_path: Path) -> None:
    """A torch layer's step (nn.Linear, with a parametrization the script defines): its bundle carried
    torch's own nn/modules/linear.py beside the script, and a replay with the bundled source made
    torch and torch.nn empty packages while it loaded the script ("module 'torch.nn' has no attribute
    'Module'"). Files of installed packages are not carried."""
    from replayer.bundles import installed

    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text(PARAMETRIZED)
    res = python("train.py", "run.zarr", cwd=project)
    assert res.returncode == 0, res.stderr
    assert installed(torch.nn.modules.linear.__file__) and installed(warnings.__file__)
    assert not installed(str(project / "train.py"))
    assert not installed("/venv/lib/python3.11/site-packages/mymodel/__init__.py")  # a project pip-installed
    made = pdbg("bundle", "run.zarr", "2@iter=1", "-o", "b.pdbg", "--verify", "--json", cwd=project)
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout)["sources"] == [str(project / "train.py")]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.move(project / "b.pdbg", elsewhere / "b.pdbg")
    shutil.rmtree(project)
    res = pdbg("replay", "b.pdbg", "--use-bundled-source", cwd=elsewhere)
    assert res.returncode == 0 and "MATCH: bit for bit" in res.stdout, res.stdout + res.stderr


class EncoderDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 4)
        self.mid = nn.Tanh()
        self.dec = self.enc  # one module under two names (weights shared by reuse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dec(self.mid(self.enc(x)))


def test_a_module_reached_under_two_names_is_selected_by_either(tmp_path: Path) -> None:
    """`self.dec = self.enc`: --modules dec recorded no step ("'dec' matched no module; the module paths
    called were: '', 'enc', 'mid'"), though model.dec was called. A glob naming any of a module's
    names selects it; its calls are recorded under its first name, and replay bit for bit."""
    torch.manual_seed(0)
    model = EncoderDecoder()
    path = tmp_path / "run.zarr"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with recorder.record(path, model=model, modules="dec", mode="full"):
            model(torch.randn(2, 4)).sum().backward()
    assert not [w for w in caught if "matched no module" in str(w.message)]
    rec = replayer.open(path)
    assert [(s.module_path, s.phase, s.call) for s in rec.steps] == [
        ("enc", "forward", 0), ("enc", "forward", 1), ("enc", "backward", 1), ("enc", "backward", 0)]
    assert all(replayer.replay(rec, i).match for i in range(len(rec)))
