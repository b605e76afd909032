"""torch's own layers picked by a glob, trained and evaluated: every forward and backward step replays
bit for bit, without a warning. Their state beyond parameters and buffers is rebuilt: an RNN's
references to its weights (``_flat_weights``), a Transformer layer's activation function (F.relu),
nn.MultiheadAttention's fast path (taken only when query is key is value)."""

from __future__ import annotations

import contextlib
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import recorder
import replayer
from recorder.errors import ReplayError
from tests.cli import pdbg


class Zoo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8, padding_idx=0)
        self.lstm = nn.LSTM(8, 8, batch_first=True, num_layers=2, bidirectional=True)
        self.gru = nn.GRU(16, 8, batch_first=True)
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 2,
                                         enable_nested_tensor=False)
        self.bn = nn.BatchNorm1d(8)
        self.conv = nn.Conv1d(8, 8, 3, padding=1, padding_mode="reflect")
        self.norm = nn.LayerNorm(8)
        self.act = nn.PReLU()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x, _ = self.lstm(self.emb(tokens))
        x, _ = self.gru(x)
        x, _ = self.mha(x, x, x, need_weights=False)
        x = self.bn(self.enc(x).transpose(1, 2))
        return self.act(self.norm(self.conv(x).transpose(1, 2)))


def test_torch_layers_replay_bit_for_bit(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Zoo()
    opt = torch.optim.Adam(model.parameters())
    tokens = torch.randint(0, 20, (4, 6))
    with recorder.record(tmp_path / "run.zarr", model=model, optimizer=opt, mode="full", modules=["*"]) as run:
        for _ in range(2):
            model(tokens).square().mean().backward()
            opt.step()
            opt.zero_grad()
        model.eval()
        with torch.no_grad():
            model(tokens)
    assert run.status == "complete" and run.failure is None
    rec = replayer.open(tmp_path / "run.zarr")
    names = {"Embedding", "LSTM", "GRU", "MultiheadAttention", "TransformerEncoder", "BatchNorm1d", "Conv1d",
             "LayerNorm", "PReLU"}
    assert [s.name for s in rec.steps.filter(iteration=2)] == [
        "Embedding", "LSTM", "GRU", "MultiheadAttention", "TransformerEncoder", "BatchNorm1d", "Conv1d",
        "LayerNorm", "PReLU"]
    assert {s.name for s in rec.steps} == names and len(rec.steps) == 9 * 2 * 2 + 9
    for step in rec.steps:
        result = replayer.replay(rec, step.index)
        assert result.match and result.warnings == [], (step.index, step.name, step.phase, result.warnings,
                                                        [d.summary() for d in result.outputs])
        assert set(result.rebuilt.values()) <= {"skeleton"}, result.rebuilt


class PatchedLSTM(nn.LSTM):
    """What a user swaps in to try a fix: the same layer with a forward of its own."""

    def forward(self, x: torch.Tensor, hx: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
        out, state = super().forward(x, hx)
        return out * 2, state


class BrokenLSTM(nn.LSTM):
    def forward(self, x: torch.Tensor, hx: Any = None) -> Any:
        raise RuntimeError("a fix that does not work yet\n(with a second line)")


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(4, 6, batch_first=True)
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])


def test_a_swapped_rnn_gets_the_recorded_weights(tmp_path: Path) -> None:
    """A module rebuilt from its skeleton for a swap takes the recorded tensors whatever the skeleton's
    stand-ins look like, and its references to them (an RNN's _flat_weights) point at them."""
    torch.manual_seed(0)
    model = Tagger()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with recorder.record(tmp_path / "run.zarr", model=model, optimizer=opt, mode="full", modules=["rnn"]):
        for _ in range(2):
            model(torch.randn(3, 5, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    rec = replayer.open(tmp_path / "run.zarr")
    forward, backward = rec.step("LSTM@iter=1"), rec.step("LSTM@iter=1:backward")
    for step in (forward, backward):
        same = replayer.replay(rec, step.index, swap={".": nn.LSTM})  # the same code: bit for bit again
        assert same.match and len(same.outputs) >= 3, [d.summary() for d in same.outputs]
        assert not [w for w in same.warnings if "shapes differ" in w or "left as the replacement" in w]
    patched = replayer.replay(rec, forward.index, swap={".": PatchedLSTM})
    recorded = forward.tensor("output.0")
    assert torch.equal(patched.values["output.0"], recorded * 2)  # its forward ran on the recorded weights
    with pytest.raises(ReplayError, match=r"^backward step \d+: rerunning its forward \(step \d+, LSTM\) raised "
                                          r"RuntimeError: a fix that does not work yet$"):
        replayer.replay(rec, backward.index, swap={".": BrokenLSTM})


class ScriptedInner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class WithScripted(nn.Module):
    """A model holding a TorchScript submodule (a scripted activation, a feature extractor shipped as TorchScript)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = torch.jit.script(ScriptedInner())
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(x))


def _train_scripted(path: Path | None, modules: list[str]) -> torch.Tensor:
    torch.manual_seed(0)
    model = WithScripted()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with recorder.record(path, model=model, optimizer=opt, modules=modules) if path else contextlib.nullcontext():
        for _ in range(2):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    return model.head.weight.detach().clone()


def test_a_model_holding_a_torchscript_module_records_and_says_why_it_is_not_replayed(tmp_path: Path) -> None:
    """A glob over a model with a TorchScript submodule: recording used to stop at the first call
    ("selecting modules of a compiled model": a ScriptModule's class refuses to give its forward).
    Now the selected plain module records and replays; the TorchScript module, selected, records,
    and its replay is refused in one line (a skeleton cannot make compiled code again), listed by
    `pdbg verify`, which still verifies the rest."""
    import warnings

    from recorder import RecorderWarning

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        head = _train_scripted(tmp_path / "head.zarr", ["head"])
        both = _train_scripted(tmp_path / "both.zarr", ["head", "enc"])
    assert not [w for w in said if issubclass(w.category, RecorderWarning)]  # no "recording stopped"
    assert torch.equal(head, _train_scripted(None, [])) and torch.equal(both, head)
    rec = replayer.open(tmp_path / "head.zarr")
    assert rec.status == "complete" and len(rec) == 4
    assert all(replayer.replay(rec, i).match for i in range(len(rec)))
    rec = replayer.open(tmp_path / "both.zarr")
    assert rec.status == "complete" and len(rec) == 8
    scripted = [s for s in rec.steps if s.module_path == "enc"]
    assert len(scripted) == 4
    with pytest.raises(ReplayError, match=r"^the step holds a TorchScript module \(made by torch.jit.script or "
                                          r"trace\), which a replay cannot rebuild; to replay it, record the Python "
                                          r"module it was scripted from$"):
        replayer.replay(rec, scripted[0].index)
    res = pdbg("verify", str(tmp_path / "both.zarr"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"{tmp_path / 'both.zarr'}: 4 of 4 steps replayed bit for bit (100.0%); 4 steps "
                                 "could not be replayed")
    assert res.stdout.count("the step holds a TorchScript module") == 1  # one line for one reason
    assert "\n  4 steps (step " in res.stdout


class Residual(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


@recorder.paper_step("Encoder", description="twelve residual blocks, two named projections, parameters w then b")
class OrderedStack(nn.Module):
    """Children, parameters and dict items whose order is not their names' order: a ModuleList of 12
    ("10" sorts before "2"), a ModuleDict whose first key sorts last, parameters w before b."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Residual(d) for _ in range(12))
        self.proj = nn.ModuleDict({"z_in": nn.Linear(d, 2 * d), "a_out": nn.Linear(2 * d, d)})
        self.w = nn.Parameter(torch.randn(d))
        self.b = nn.Parameter(torch.randn(d))

    def forward(self, x: torch.Tensor, scales: dict[str, float]) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        for layer in self.proj.values():
            x = layer(x)
        first, second = (torch.tensor(v) for v in scales.values())  # the dict's order, as the caller made it
        own_first, own_second = list(self.parameters())[:2]  # w then b: a module's own are listed first
        return x * own_first * first - own_second * second


def test_children_parameters_and_dict_items_replay_in_the_order_they_ran(tmp_path: Path) -> None:
    """Stored with sorted keys, block 10 ran before block 2 in a replay (a MISMATCH), the ModuleDict's
    layers ran in the wrong order (shapes that do not fit), and the dict argument's items swapped."""
    torch.manual_seed(0)
    model = OrderedStack()
    with recorder.record(tmp_path / "run.zarr", model=model, mode="full"):
        model(torch.randn(4, 8), {"z": 2.0, "a": 0.5}).square().mean().backward()
    with replayer.open(tmp_path / "run.zarr") as rec:
        forward, backward = rec.step(0), rec.step(1)
        assert list(forward.arguments["args"][1]) == ["z", "a"]
        for step in (forward, backward):
            result = replayer.replay(rec, step.index)
            assert result.match and result.warnings == [], (step.phase, result.warnings,
                                                            [d.summary() for d in result.outputs])


def test_a_recording_with_sorted_names_gets_its_numbered_children_back_in_order() -> None:
    """Before schema 1.16 a module's children were stored in name order: numbered ones are put back in
    their numbers' order; a Sequential's named children cannot be, and the replay says so where it differs."""
    from replayer.rebuild import Builder, Rebuilt

    out = Rebuilt(nn.Module())
    numbered = {str(i): {"class": "x"} for i in sorted(range(12), key=str)}
    assert list(Builder._children_in_order(nn.ModuleList, numbered, "blocks", out)) == [str(i) for i in range(12)]
    assert out.warnings == []
    named = {"a_out": {}, "z_in": {}}
    assert list(Builder._children_in_order(nn.Sequential, named, "proj", out)) == ["a_out", "z_in"]
    assert out.warnings == [] and out.order_doubts == ["proj: this Sequential's children"]  # said on a difference


class FakeQuantNet(nn.Module):
    """torch.ao QAT as a user writes it: a FakeQuantize built with its observer class and a qscheme."""

    def __init__(self) -> None:
        from torch.ao.quantization import FakeQuantize, MovingAverageMinMaxObserver

        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.fq = FakeQuantize(observer=MovingAverageMinMaxObserver, quant_min=0, quant_max=255, dtype=torch.quint8,
                               qscheme=torch.per_tensor_affine)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fq(self.fc(x))


def test_fake_quantize_and_its_observer_replay_bit_for_bit(tmp_path: Path) -> None:
    """A FakeQuantize and its observer hold a torch.qscheme and were built with an observer class, both once
    unrecordable: the replay raised AttributeError ('no attribute qscheme'), which verify called a MISMATCH.
    Now both are recorded by name, and every step replays bit for bit, the observer's buffers included."""
    torch.manual_seed(0)
    model = FakeQuantNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    modules = ["fq", "fq.activation_post_process"]
    with recorder.record(tmp_path / "run.zarr", model=model, optimizer=opt, modules=modules):
        for _ in range(3):
            model(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    rec = replayer.open(tmp_path / "run.zarr")
    assert {s.name for s in rec.steps} == {"FakeQuantize", "MovingAverageMinMaxObserver"}
    for step in rec.steps:
        result = replayer.replay(rec, step.index)
        assert result.match, (step.index, step.name, step.phase, result.warnings, [d.summary() for d in result.outputs])
        assert not any("could not be recorded" in w for w in result.warnings), result.warnings
    res = pdbg("verify", "run.zarr", cwd=tmp_path)
    assert res.returncode == 0 and "replayed bit for bit (100.0%)" in res.stdout, res.stdout + res.stderr


class Thresholded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.pick = lambda x: x.clamp(min=0)  # a lambda: not data, and no constructor arguments to rebuild with

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pick(self.lin(x))


def test_a_step_whose_rebuild_lacks_an_attribute_is_not_replayable_not_a_mismatch(tmp_path: Path) -> None:
    """A module rebuilt without an attribute that could not be recorded raised on replay, and verify listed
    the step as a MISMATCH, as if its numbers differed: it is listed as not replayed, saying why."""
    model = nn.Sequential(Thresholded())
    with recorder.record(tmp_path / "run.zarr", model=model, modules=["0"]):
        model(torch.randn(2, 4)).sum().backward()
    rec = replayer.open(tmp_path / "run.zarr")
    with pytest.raises(ReplayError, match="the module was rebuilt incomplete .*attributes pick"):
        replayer.replay(rec, 0)
    res = pdbg("verify", "run.zarr", "--json", cwd=tmp_path)
    doc = json.loads(res.stdout)
    assert doc["mismatches"] == [] and len(doc["not_replayed"]) == 2, doc
    assert "raised AttributeError" in doc["not_replayed"][0]["reason"], doc


class Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x) * x


def _function_module() -> type[nn.Module]:
    class Function(nn.Module):  # made inside a function, as transformers' kernel-function wrappers are
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(x)

    return Function


ACT = _function_module()()  # a module-level instance of it: where a replay finds its class again


class Routed(nn.Module):
    """Keeps modules that are only their class in a dict, unregistered (Llama's attention keeps its
    ``_kernel_funcs`` so)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self._funcs = {"act": type(ACT)(), "gate": Gate()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return self._funcs["act"](h) + self._funcs["gate"](h)


def test_modules_that_are_only_their_class_are_made_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dict of modules with no state of their own (one of a class made inside a function, found as the
    type of a module-level object; one importable) is recorded without a warning, made again by calling
    each class, and the steps replay bit for bit forward and backward. Where a class cannot be made
    again at the replay, the replay names the attribute and the step is not replayed (not a MISMATCH)."""
    model = nn.Sequential(Routed())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with recorder.record(tmp_path / "run.zarr", model=model, modules=["0"]):
            model(torch.randn(2, 4)).sum().backward()
    assert not [str(w.message) for w in caught if issubclass(w.category, recorder.RecorderWarning)]
    rec = replayer.open(tmp_path / "run.zarr")
    assert [s.phase for s in rec.steps] == ["forward", "backward"]
    for step in rec.steps:
        result = replayer.replay(rec, step.index)
        assert result.match and result.outputs and not result.warnings, result

    def refuse(self: nn.Module) -> None:
        raise RuntimeError("no longer made without arguments")

    monkeypatch.setattr(Gate, "__init__", refuse)
    with pytest.raises(ReplayError, match="rebuilt incomplete") as raised:
        replayer.replay(rec, 0)
    assert "attribute _funcs could not be made again (Gate() failed: RuntimeError: no longer made" in str(raised.value)


def test_an_older_recordings_numbered_module_dict_keeps_its_order_and_its_doubts_are_said_on_a_difference() -> None:
    """A ModuleDict's keys are names even when they are numbers (an FPN's "32", "16", "8"): a recording
    before 1.16 (names stored sorted) no longer has them put in their numbers' order, which was the
    wrong one; a Sequential's or ModuleDict's children whose order cannot be told are doubts, named
    where the replay differs, not a warning on a replay that matches."""
    from replayer.rebuild import Builder, Rebuilt

    out = Rebuilt(nn.Module())
    strides = {"16": {}, "32": {}, "8": {}}  # as 1.15 stored {"32", "16", "8"}
    assert list(Builder._children_in_order(nn.ModuleDict, strides, "fpn", out)) == ["16", "32", "8"]
    assert list(Builder._children_in_order(nn.ModuleList, {"0": {}, "10": {}, "2": {}}, "b", out)) == ["0", "2", "10"]
    assert out.warnings == [] and out.order_doubts == ["fpn: this ModuleDict's children"]


@recorder.paper_step("Eq. 9", description="a weighted sum of a dict's values, in its order")
def weighted(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    first, second = parts.values()
    return first * 2 + second


def test_a_difference_in_a_recording_before_schema_1_16_names_what_it_did_not_hold(tmp_path: Path) -> None:
    """A 1.15 recording's dict argument came back in name order and replayed other values, with no word of
    why (nor in verify): the replay names the older schema's limits as the likely cause."""
    from recorder.store import layout as layout_mod
    from tests.sealing import as_schema, rewrite_docs

    path = tmp_path / "run.zarr"
    with recorder.record(path, mode="full"):
        weighted({"z": torch.ones(3), "a": torch.arange(3.0)})
    def sorted_as_before(i: int, doc: Any) -> Any:  # the dict argument's items in name order, as 1.15 stored them
        if isinstance(doc, dict) and doc.get("args") and isinstance(doc["args"][0], dict) and "z" in doc["args"][0]:
            return {**doc, "args": [dict(sorted(doc["args"][0].items())), *doc["args"][1:]]}
        return None

    rewrite_docs(path, sorted_as_before)
    as_schema(path, "1.15")
    with replayer.open(path) as rec:
        assert rec.reader.schema_version == "1.15" and layout_mod.parse_version("1.15") < (1, 16)
        result = replayer.replay(rec, 0)
    assert not result.match
    assert any(w.startswith("recorded with schema 1.15, before 1.16: its documents held") and "likely cause" in w
               for w in result.warnings), result.warnings
    res = pdbg("verify", str(path), cwd=tmp_path)
    assert "recorded with schema 1.15, before 1.16" in res.stdout + res.stderr, res.stdout
