"""What a model's step holds or is given beyond tensors, as language-model code has it: a config
dataclass with attributes set after ``__init__`` (which attention implementation to use), an
output layer tied to the embedding: recorded as data, and the steps replay bit for bit. A cache
object on an abstract base class (as Hugging Face's are) is not data: a step given one is refused
in one line, also when it sits inside an object that is."""

from __future__ import annotations

import abc
import dataclasses
import io
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import recorder
import replayer
from recorder import jsonval
from recorder.errors import ReplayError


@dataclasses.dataclass
class Config:
    width: int = 8
    heads: int = 2

    def __post_init__(self) -> None:
        self._attention = "plain"  # what a constructor makes; the model's loader sets it afterwards


class Layer(abc.ABC):  # noqa: B024 - a base class with no abstract method, as caches have
    pass


class KVLayer(Layer):
    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None

    def update(self, k: torch.Tensor) -> torch.Tensor:
        self.keys = k if self.keys is None else torch.cat([self.keys, k], dim=1)
        return self.keys


class Cache:
    def __init__(self, n: int) -> None:
        self.layers = [KVLayer() for _ in range(n)]


@recorder.paper_step("Eq. 3", description="attention that a config chooses, with a cache")
class Block(nn.Module):
    def __init__(self, config: Config, index: int) -> None:
        super().__init__()
        self.config, self.index = config, index
        self.qkv = nn.Linear(config.width, 3 * config.width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor, cache: Cache | None) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        k = k if cache is None else cache.layers[self.index].update(k)
        if self.config._attention == "fused":
            return x + self.drop(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.drop(torch.softmax(q @ k.transpose(1, 2) / 3.0, dim=-1) @ v)


class TinyLM(nn.Module):
    def __init__(self, config: Config, use_cache: bool = False) -> None:
        super().__init__()
        self.use_cache = use_cache
        self.emb = nn.Embedding(16, config.width)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(2))
        self.head = nn.Linear(config.width, 16, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        cache = Cache(len(self.blocks)) if self.use_cache else None
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h, cache)
        return F.cross_entropy(self.head(h).flatten(0, 1), ids.flatten())


def train(path: Path, use_cache: bool) -> replayer.Recording:
    torch.manual_seed(0)
    config = Config()
    config._attention = "fused"
    model = TinyLM(config, use_cache)
    recorder.annotate(model, "Model", description="the whole language model")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 16, (2, 5))
    with recorder.record(path, model=model, optimizer=opt, mode="full"):
        for _ in range(2):
            model(ids).backward()
            opt.step()
            opt.zero_grad()
    return replayer.open(path)


def test_configs_and_tied_weights_replay_bit_for_bit(tmp_path: Path) -> None:
    rec = train(tmp_path / "run.zarr", use_cache=False)
    assert len(rec.steps) == 12
    for step in rec.steps:
        result = replayer.replay(rec, step.index)
        assert result.match and result.outputs, (step.selector, [d.summary() for d in result.outputs])
        assert not [w for w in result.warnings if "tied" in w or "not recorded" in w], result.warnings
    model_grads = replayer.replay(rec, "Model@iter=1:backward")
    assert "param_grad:emb.weight" in model_grads.values  # the tied weight's whole gradient, as trained


def test_a_step_given_a_cache_object_is_refused_in_one_line(tmp_path: Path) -> None:
    rec = train(tmp_path / "run.zarr", use_cache=True)
    for step in rec.steps:
        if step.name == "TinyLM":  # it makes the cache itself
            assert replayer.replay(rec, step.index).match
            continue
        with pytest.raises(ReplayError, match=r"was called with a tests Cache as cache \(its layers: KVLayer "
                                               r"objects\), which could not be recorded as data") as info:
            replayer.replay(rec, step.index)
        assert "\n" not in str(info.value)


def test_a_dataclass_keeps_attributes_set_after_its_constructor() -> None:
    config = Config(width=4)
    config._attention = "fused"
    doc = jsonval.encode(config)
    assert doc["$dataclass"]["attrs"] == {"_attention": "fused"}
    back = jsonval.decode(jsonval.loads(jsonval.dumps(doc)), import_types=True)
    assert back == config and back._attention == "fused"
    assert "attrs" not in jsonval.encode(Plain(1))["$dataclass"]  # all its state is its fields
    assert jsonval.decode(jsonval.encode(Config()), import_types=True)._attention == "plain"


@dataclasses.dataclass
class Plain:
    n: int


@dataclasses.dataclass
class Guarded:
    n: int

    def __post_init__(self) -> None:
        self._lock = threading.Lock()  # not data: recorded as opaque
        self._half = self.n / 2

    @property
    def doubled(self) -> int:
        return self.n * 2

    @doubled.setter
    def doubled(self, value: int) -> None:
        raise AssertionError("a recording ran a property setter")


def test_a_dataclass_keeps_what_its_constructor_made_of_what_was_not_data() -> None:
    back = jsonval.decode(jsonval.encode(Guarded(3)), import_types=True)
    with back._lock:  # the constructor's lock, not a stand-in for the recorded one
        assert back._half == 1.5
    doc = jsonval.encode(Guarded(3))
    doc["$dataclass"]["attrs"]["doubled"] = 7  # a damaged or crafted document: data only, no setter runs
    assert jsonval.decode(doc, import_types=True).doubled == 6


class Holder:
    def __init__(self, stream: Any) -> None:
        self.stream = stream


@recorder.paper_step("Eq. 9", description="reads from a stream it is given")
def read_scale(x: torch.Tensor, holder: Holder) -> torch.Tensor:
    return x * float(len(holder.stream.getvalue()))


def test_an_argument_object_holding_what_could_not_be_recorded_stops_the_replay(tmp_path: Path) -> None:
    with recorder.record(tmp_path / "run.zarr", mode="full"):
        read_scale(torch.ones(3), Holder(io.BytesIO(b"not data")))
    rec = replayer.open(tmp_path / "run.zarr")
    with pytest.raises(ReplayError, match=r"was called with a tests Holder as holder \(its stream: a BytesIO\), "
                                               r"which could not be recorded as data") as info:
        replayer.replay(rec, 0)
    assert "\n" not in str(info.value)


class Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids))


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = Body()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.body(ids)


def test_a_swapped_module_keeps_its_weights_tied(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Outer()
    recorder.annotate(model, "Model")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with recorder.record(tmp_path / "run.zarr", model=model, optimizer=opt, mode="full"):
        for _ in range(2):
            model(torch.randint(0, 10, (3, 5))).square().mean().backward()
            opt.step()
            opt.zero_grad()
    rec = replayer.open(tmp_path / "run.zarr")
    result = replayer.replay(rec, "Model@iter=1:backward", swap={"body": Body})  # the same class, built anew
    assert result.match and [d.name for d in result.outputs] == ["body.emb.weight"], [
        d.summary() for d in result.outputs]


@recorder.paper_step("Eq. 3", description="a residual gate warmed up over calls: g = min(1, t / 10)")
class WarmupGate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.t = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.t += 1  # the call changes its own state: the replay starts from the state the call found
        return x + min(1.0, self.t / 10) * self.lin(x)


@recorder.paper_step("Eq. 4", description="a softmax with an annealed temperature")
class Anneal(nn.Module):
    def __init__(self, keep_center: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)
        self.tau = 1.0  # annealed by the training loop
        self.shape_of = lambda t: t.shape  # not data: the module is rebuilt by its constructor
        self.center = torch.zeros(4) if keep_center else None  # a tensor attribute, not a buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.lin(x))
        return F.softmax((h if self.center is None else h - self.center) / self.tau, -1)


def train_scheduled(path: Path, model: nn.Module, schedule: Any) -> None:
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with recorder.record(path, model=model, optimizer=opt, mode="full"):
        for it in range(3):
            schedule(model, it)
            out = model(torch.randn(3, 4))
            if getattr(model, "center", None) is not None:
                model.center = 0.9 * model.center + 0.1 * out.detach().mean(0)
            out.pow(2).sum().backward()
            opt.step()
            opt.zero_grad()


def anneal(model: nn.Module, it: int) -> None:
    model.tau = 1.0 / (1 + it)  # a temperature schedule
    model.drop.p = 0.5 / (1 + it)  # a dropout schedule on a child
    if it == 2:
        model.drop.eval()  # a child put in eval mode


@pytest.mark.parametrize("model,schedule", [(WarmupGate, lambda m, it: None), (Anneal, anneal)],
                         ids=["state the call changes", "schedules, rebuilt by its constructor"])
def test_attributes_training_changes_replay_as_each_call_found_them(tmp_path: Path, model: Any,
                                                                   schedule: Any) -> None:
    """A module's attributes are recorded as each call found them: a counter its forward moves, a
    temperature and a child's dropout rate the training loop anneals, a child put in eval mode.
    Every call replays bit for bit, forward and backward, also when the module is rebuilt by its
    constructor (what it holds that is not data comes from there; the recorded values go on top)."""
    path = tmp_path / "run.zarr"
    train_scheduled(path, model(), schedule)
    rec = replayer.open(path)
    steps = rec.steps.filter(name=model.__name__)
    assert len(steps) == 6
    for step in steps:
        result = replayer.replay(rec, step.index)
        assert result.match and not result.warnings, (step.selector, result.warnings)


def test_a_mismatch_names_the_attributes_a_constructor_made(tmp_path: Path) -> None:
    """A tensor kept as a module attribute (not a buffer) is not recorded: the module's constructor
    makes it at replay. When training changed it and the replay differs, the replay says so."""
    path = tmp_path / "run.zarr"
    train_scheduled(path, Anneal(keep_center=True), lambda m, it: None)
    rec = replayer.open(path)
    first, later = replayer.replay(rec, "Eq. 4@iter=0"), replayer.replay(rec, "Eq. 4@iter=1")
    assert first.match and not first.warnings
    assert not later.match and later.warnings == [
        "attributes that could not be recorded as data came from the module's constructor (the step's module: "
        f"shape_of (the lambda {__name__}:Anneal.__init__.<locals>.<lambda>), center (a tensor that is no parameter "
        "or buffer: register_buffer has it "
        "recorded)); if training changed them after construction (a "
        "tensor kept as an attribute, not a buffer), the replay used other values (a likely cause of any difference)"]


def test_a_module_keeps_nothing_of_the_recorder_in_its_own_state(tmp_path: Path) -> None:
    """The constructor arguments a replay rebuilds a module from are kept beside it, not in its
    __dict__: the user's checkpoint of the model (torch.save(model)) holds nothing of the recorder's,
    and the replay still rebuilds it by its constructor."""
    model = WarmupGate()
    assert not [k for k in vars(model) if "pdbg" in k]
    saved = io.BytesIO()
    torch.save(model, saved)
    assert b"pdbg" not in saved.getvalue()
    path = tmp_path / "run.zarr"
    with recorder.record(path, model=model, mode="full"):
        model(torch.randn(2, 4))
    result = replayer.replay(replayer.open(path), 0)
    assert result.match and result.rebuilt[""] in ("constructor", "skeleton")
    assert replayer.open(path).step(0)._doc("module")["init"] == {"class": f"{__name__}:WarmupGate", "args": [],
                                                                    "kwargs": {}}
