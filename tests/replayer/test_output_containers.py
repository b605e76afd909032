"""Steps that return their tensors in a named tuple, a dataclass, a dict subclass (Hugging Face's
``ModelOutput``) or one of torch's return types: their backward is recorded (grad outputs by the
output's record names) and replays bit for bit, training is unchanged, and a backward with nothing
to start from or nothing to compare is refused in one line instead of reported as a match."""

from __future__ import annotations

import collections
import dataclasses
import json
import typing
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import recorder
import replayer
from recorder.errors import ReplayError
from tests.cli import pdbg_here

transformers_outputs = pytest.importorskip("transformers.modeling_outputs")


class Pair(typing.NamedTuple):
    y: torch.Tensor
    aux: torch.Tensor


Old = collections.namedtuple("Old", ["y", "aux", "note"])


@dataclasses.dataclass
class Out:
    y: torch.Tensor
    aux: torch.Tensor
    label: str = "out"


@dataclasses.dataclass(frozen=True)
class Frozen:
    y: torch.Tensor
    aux: torch.Tensor


class Plain:
    def __init__(self, y: torch.Tensor) -> None:
        self.y = y


@dataclasses.dataclass
class Uncopyable:
    y: torch.Tensor

    def __copy__(self) -> Uncopyable:
        raise RuntimeError("no copies of this one")


def _wrap(kind: str, y: torch.Tensor, aux: torch.Tensor) -> Any:
    if kind == "typed":
        return Pair(y, aux)
    if kind == "namedtuple":
        return Old(y, aux, "three fields, one not a tensor")
    if kind == "dataclass":
        return Out(y, aux)
    if kind == "frozen":
        return Frozen(y, aux)
    if kind == "ordered":
        return collections.OrderedDict(y=y, aux=aux)
    if kind == "model_output":
        return transformers_outputs.CausalLMOutput(loss=aux, logits=y)
    if kind == "nested":
        return y, [{"aux": aux}]
    if kind == "int_keys":
        return {0: y, 1: aux}
    if kind == "hidden":
        return y, Plain(aux)
    if kind == "plain":
        return Plain(y)
    if kind == "uncopyable":
        return Uncopyable(y)
    raise AssertionError(kind)


def _y(out: Any) -> torch.Tensor:
    if isinstance(out, dict) and "logits" in out:
        assert out["logits"] is out.logits and out["loss"] is out.loss  # one object, as without recording
        return out.logits
    if isinstance(out, tuple) and type(out) is tuple or isinstance(out, dict) and 0 in out:
        return out[0]
    return out["y"] if isinstance(out, dict) else out.y


def _aux(out: Any) -> torch.Tensor:
    if isinstance(out, (Plain, Uncopyable)):
        return out.y.mean()
    if isinstance(out, dict) and "logits" in out:
        return out.loss
    if isinstance(out, dict) and 1 in out:
        return out[1]
    if isinstance(out, tuple) and type(out) is tuple:
        return out[1][0]["aux"] if isinstance(out[1], list) else out[1].y
    return out["aux"] if isinstance(out, dict) else out.aux


@recorder.paper_step("Eq. 7", description="a block returning a container")
class Block(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(6, 6)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> Any:
        h = self.drop(self.lin(x))
        return _wrap(self.kind, torch.tanh(h), h.pow(2).mean())


@recorder.paper_step("Eq. 8", description="a row's largest value and where it is")
def peak(h: torch.Tensor) -> Any:
    return torch.max(h, dim=-1)


KINDS = ["typed", "namedtuple", "dataclass", "frozen", "ordered", "model_output", "nested"]


class Model(nn.Module):
    def __init__(self, kinds: list[str]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(k) for k in kinds)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        loss = torch.zeros(())
        for block in self.blocks:
            out = block(h)
            h = _y(out)
            loss = loss + _aux(out)
        return loss + peak(h).values.sum()


def train(path: Path | None, kinds: list[str]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = Model(kinds)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    with recorder.record(path, model=model, optimizer=opt, mode="full") if path else _nothing():
        for _ in range(2):
            loss = model(torch.randn(4, 6))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach().clone())
    return losses, [p.detach().clone() for p in model.parameters()]


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1).view(torch.uint8)

    return len(a) == len(b) and all(torch.equal(raw(x), raw(y)) for x, y in zip(a, b))


def test_container_outputs_record_their_backward_and_replay(tmp_path: Path) -> None:
    plain = train(None, KINDS)
    recorded = train(tmp_path / "run.zarr", KINDS)
    assert _bitwise(plain[0], recorded[0]) and _bitwise(plain[1], recorded[1])
    rec = replayer.open(tmp_path / "run.zarr")
    want = {"typed": ["output.y", "output.aux"], "namedtuple": ["output.y", "output.aux"],
            "dataclass": ["output.y", "output.aux"], "frozen": ["output.y", "output.aux"],
            "ordered": ["output.y", "output.aux"], "model_output": ["output.loss", "output.logits"],
            "nested": ["output.0", "output.1.0.aux"]}
    backward = rec.steps.filter(name="Block", phase="backward")
    for i, kind in enumerate(KINDS):
        steps = [s for s in backward if s.module_path == f"blocks.{i}"]
        assert len(steps) == 2, kind
        for step in steps:
            assert sorted(r.name for r in step.records if r.role == "grad_output") == sorted(want[kind]), kind
    peaks = rec.steps.filter(name="peak", phase="backward")
    assert [[r.name for r in s.records if r.role == "grad_output"] for s in peaks] == [["output.0"]] * 2
    compared = 0
    for step in rec.steps:
        result = replayer.replay(rec, step.index)
        assert result.match, (step.index, step.name, step.phase, [d.summary() for d in result.outputs])
        compared += len(result.outputs)
    backward_grads = sum(len([r for r in s.records if r.role in ("grad_input", "param_grad")])
                         for s in rec.steps.filter(phase="backward"))
    assert backward_grads == (2 * len(KINDS) + len(KINDS) - 1 + 1) * 2  # weights, biases; inputs after the first
    assert compared >= backward_grads


def test_a_dict_keyed_by_ints_records_its_backward_and_replays(tmp_path: Path) -> None:
    """``{0: y, 1: aux}`` (outputs per scale or per head): its tensors are followed for gradients by
    the names its forward records them by, ``output.0`` and ``output.1``, so the backward replays bit
    for bit (before, they were not followed and the backward had no grad outputs to start from)."""
    plain = train(None, ["int_keys"])
    recorded = train(tmp_path / "run.zarr", ["int_keys"])
    assert _bitwise(plain[0], recorded[0]) and _bitwise(plain[1], recorded[1])
    rec = replayer.open(tmp_path / "run.zarr")
    backward = rec.steps.filter(name="Block", phase="backward")
    assert len(backward) == 2
    for step in backward:
        assert sorted(r.name for r in step.records if r.role == "grad_output") == ["output.0", "output.1"]
    for step in rec.steps:
        assert not any("not followed" in n for n in step.extra.get("notes", [])), step.extra
        result = replayer.replay(rec, step.index)
        assert result.match, (step.index, step.name, step.phase, [d.summary() for d in result.outputs])


@pytest.mark.parametrize("kind, why", [("plain", "output.y not followed for gradients"),
                                       ("uncopyable", "output.y: in an object that could not be copied")])
def test_a_backward_without_grad_outputs_is_refused_in_one_line(tmp_path: Path, kind: str, why: str) -> None:
    plain = train(None, [kind])
    recorded = train(tmp_path / "run.zarr", [kind])
    assert _bitwise(plain[0], recorded[0]) and _bitwise(plain[1], recorded[1])  # training goes on unchanged
    rec = replayer.open(tmp_path / "run.zarr")
    steps = rec.steps.filter(name="Block", phase="backward")
    assert len(steps) == 2
    for step in steps:
        assert [r.role for r in step.records if r.role == "grad_output"] == []
        with pytest.raises(ReplayError, match=f"no grad outputs to start a backward from: .*{why}") as info:
            replayer.replay(rec, step.index)
        assert "\n" not in str(info.value)
    for step in rec.steps.filter(phase="forward"):
        assert replayer.replay(rec, step.index).match


def test_an_unfollowed_output_is_named_and_its_backward_not_reported_as_a_match(tmp_path: Path) -> None:
    """``(y, Plain(aux))``: a tap does not rebuild an arbitrary object, so aux is not followed; the
    forward says so, and a replay of the backward, whose grads then lack what came through aux,
    warns and mismatches."""
    plain = train(None, ["hidden"])
    recorded = train(tmp_path / "run.zarr", ["hidden"])
    assert _bitwise(plain[0], recorded[0]) and _bitwise(plain[1], recorded[1])
    rec = replayer.open(tmp_path / "run.zarr")
    fwd = rec.steps.filter(name="Block", phase="forward")[0]
    assert any(n.startswith("output.1.y not followed for gradients") for n in fwd.extra["notes"])
    backward = rec.steps.filter(name="Block", phase="backward")[0]
    assert [r.name for r in backward.records if r.role == "grad_output"] == ["output.0"]
    result = replayer.replay(rec, backward.index)
    assert any("output.1.y not followed for gradients" in w for w in result.warnings)
    assert not result.match  # the bias grad lacks aux's share: reported, not hidden


def test_verify_names_an_unfollowed_output_as_the_cause_of_its_backwards_difference(tmp_path: Path) -> None:
    """``pdbg verify`` listed such a backward (a policy returning ``(probs, Normal(mu, std))`` is the common
    case) as differing with no cause, or with another warning's (a module-level number the code reads)
    while the replay's own warning said the gradients through the unfollowed output were left out: its
    line now names that output as the likely cause."""
    train(tmp_path / "run.zarr", ["hidden"])
    rec = replayer.open(tmp_path / "run.zarr")
    backward = rec.steps.filter(name="Block", phase="backward")[0]
    result = replayer.replay(rec, backward.index)
    assert any(w.startswith(f"forward step {backward.forward}: output.1.y not followed for gradients")
               and w.endswith("(a likely cause of any difference)") for w in result.warnings), result.warnings
    res = pdbg_here("verify", str(tmp_path / "run.zarr"), "--json", cwd=tmp_path)
    assert res.returncode == 1, res.stderr
    reasons = {m["step"]["index"]: m["reason"] for m in json.loads(res.stdout)["mismatches"]}
    assert "output.1.y not followed for gradients" in reasons[backward.index], reasons


class AttrDict(dict):
    """The idiom that makes a dict's items its attributes too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.__dict__ = self


@recorder.paper_step("Eq. 10", description="one list in two places, and an attribute dict")
class Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> tuple[AttrDict, dict[str, Any]]:
        hidden = [torch.tanh(self.lin(x))]
        return AttrDict(y=self.lin(x).sin()), {"hidden": hidden, "all_hidden": hidden}  # AttrDict's tap first


def _shared_training(path: Path | None) -> tuple[list[torch.Tensor], list[int], list[bool]]:
    torch.manual_seed(0)
    model = Shared()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, lengths, same = [], [], []
    with recorder.record(path, model=model, optimizer=opt, mode="full") if path else _nothing():
        for _ in range(2):
            attrs, out = model(torch.randn(4, 6))
            out["hidden"].append(out["hidden"][0] * 2)  # seen through the other place, as without recording
            lengths.append(len(out["all_hidden"]))
            same.append(attrs.y is attrs["y"])
            loss = sum(h.sum() for h in out["all_hidden"]) + attrs.y.sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach().clone())
    return losses, lengths, same


def test_shared_containers_stay_shared_and_an_attribute_dict_stays_whole(tmp_path: Path) -> None:
    plain = _shared_training(None)
    recorded = _shared_training(tmp_path / "run.zarr")
    assert _bitwise(plain[0], recorded[0]) and plain[1:] == recorded[1:] == ([2, 2], [True, True])
    rec = replayer.open(tmp_path / "run.zarr")
    fwd = rec.steps.filter(phase="forward")[0]
    assert any(n.startswith("output.0.y: in an object that could not be copied") for n in fwd.extra["notes"]), fwd.extra
    backward = rec.steps.filter(phase="backward")[0]
    grads = {r.name: backward.tensor(r.name) for r in backward.records if r.role == "grad_output"}
    assert list(grads) == ["output.1.hidden.0"]  # its own grad (1 + 2 from the appended copy), not shifted
    assert torch.equal(grads["output.1.hidden.0"], torch.full((4, 6), 3.0))
    result = replayer.replay(rec, backward.index)
    assert not result.match and any("could not be copied" in w for w in result.warnings)  # attrs.y's share


# -- arguments inside containers ------------------------------------------------------------------
@dataclasses.dataclass
class Carry:
    h: torch.Tensor
    c: torch.Tensor


@recorder.paper_step("Eq. 11", description="a list of features, which the step appends to")
def from_list(xs: list[torch.Tensor]) -> torch.Tensor:
    xs.append(xs[1] * 2)
    return xs[0].tanh()


@recorder.paper_step("Eq. 12", description="a state dict whose item the step replaces, and pairs in a kwarg")
def from_dict(state: dict[str, torch.Tensor], *, extra: tuple[Any, ...]) -> torch.Tensor:
    state["h"] = state["h"].tanh() * extra[0].y
    return state["h"] + extra[1]["z"].sin()


@recorder.paper_step("Eq. 13", description="a dataclass")
def from_carry(carry: Carry, top: torch.Tensor) -> torch.Tensor:
    return carry.h * carry.c + top


@recorder.paper_step("Eq. 14", description="an LSTM over packed sequences")
class Packed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(6, 6, batch_first=True)

    def forward(self, packed: torch.nn.utils.rnn.PackedSequence) -> torch.nn.utils.rnn.PackedSequence:
        return self.lstm(packed)[0]


class Given(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.packed = Packed()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        g = h * 3
        xs = [h, g]
        y = from_list(xs)
        assert len(xs) == 3 and xs[0] is h and xs[1] is g  # the caller's list, as the step left it
        state = {"h": y}
        z = from_dict(state, extra=(Pair(g.mean(), h), {"z": y * 2}))
        assert type(state) is dict and state["h"] is not y
        c = z.cos()
        carry = Carry(z * 1, c)
        w = from_carry(carry, z * 2)
        assert carry.c is c
        lengths = torch.tensor([4, 2, 1])
        packed = torch.nn.utils.rnn.pack_padded_sequence(w[:12].reshape(3, 4, 6), lengths, batch_first=True)
        out = torch.nn.utils.rnn.pad_packed_sequence(self.packed(packed), batch_first=True)[0]
        return out.sum() + w.sum() + xs[2].detach().sum() + state["h"].detach().sum()


def _given_training(path: Path | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = Given()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    with recorder.record(path, model=model, optimizer=opt, mode="full") if path else _nothing():
        for _ in range(2):
            loss = model(torch.randn(12, 6))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach().clone())
    return losses, [p.detach().clone() for p in model.parameters()]


def test_tensors_given_inside_containers_record_their_gradients_and_replay(tmp_path: Path) -> None:
    """A tensor autograd computed, given inside a list, dict, tuple, named tuple, dataclass or
    ``PackedSequence``, is followed for gradients: the backward step records its grad input (before,
    none was, and a NaN its backward made there was blamed on code outside every step). Lists, dicts
    and dataclasses hold the tapped tensor only while the call runs: what the step did to them (an
    append, a replaced item) is the caller's, as unrecorded, and training is bit for bit the same."""
    plain = _given_training(None)
    recorded = _given_training(tmp_path / "run.zarr")
    assert _bitwise(plain[0], recorded[0]) and _bitwise(plain[1], recorded[1])
    rec = replayer.open(tmp_path / "run.zarr")
    want = {"from_list": {"args.0.0"}, "from_dict": {"args.0.h", "kwargs.extra.0.y", "kwargs.extra.1.z"},
            "from_carry": {"args.0.h", "args.0.c", "args.1"}, "Packed": {"args.0.data"}}
    for name, names in want.items():
        for step in rec.steps.filter(name=name, phase="backward"):
            assert {r.name for r in step.records if r.role == "grad_input"} == names, (name, step.records)
    assert len(rec.steps.filter(phase="backward")) == 8
    for step in rec.steps:
        assert not any("not followed" in n for n in step.extra.get("notes", [])), step.extra
        result = replayer.replay(rec, step.index)
        assert result.match, (step.index, step.name, step.phase, [d.summary() for d in result.outputs])


@recorder.paper_step("Eq. 9", description="a dict with both 1 and '1' as keys, in and out")
def mixed_keys(parts: dict[Any, torch.Tensor]) -> dict[Any, torch.Tensor]:
    return {1: parts[1] * 2, "1": torch.tanh(parts["1"]) + parts[1]}


def _mixed_training(path: Path | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(5))
    opt = torch.optim.SGD([w], lr=0.1)
    losses = []
    with recorder.record(path, optimizer=opt, mode="full") if path else _nothing():
        for _ in range(2):
            out = mixed_keys({1: w * 3, "1": w.sin()})
            loss = out[1].sum() + out["1"].pow(2).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach().clone())
    return losses, [w.detach().clone()]


def test_a_dicts_int_key_and_its_text_as_a_key_are_recorded_apart(tmp_path: Path) -> None:
    """``{1: a, "1": b}``: both values were recorded as ``output.1`` (and given as ``args.0.1``), so a replay
    compared one with the other and said MISMATCH, and the int key's gradient was not followed. The int key is
    now ``[1]`` in the names (``output.[1]``): both are recorded, followed, and replay bit for bit."""
    plain = _mixed_training(None)
    recorded = _mixed_training(tmp_path / "run.zarr")
    assert _bitwise(plain[0], recorded[0]) and _bitwise(plain[1], recorded[1])
    rec = replayer.open(tmp_path / "run.zarr")
    forward, backward = rec.steps[0], rec.steps[1]
    assert sorted(r.name for r in forward.records) == ["args.0.1", "args.0.[1]", "output.1", "output.[1]"]
    assert sorted(r.name for r in backward.records if r.role == "grad_output") == ["output.1", "output.[1]"]
    assert sorted(r.name for r in backward.records if r.role == "grad_input") == ["args.0.1", "args.0.[1]"]
    for step in rec.steps:
        assert not any("not followed" in n for n in step.extra.get("notes", [])), step.extra
        result = replayer.replay(rec, step.index)
        assert result.match, (step.index, step.phase, [d.summary() for d in result.outputs])
