"""Activation checkpointing (torch.utils.checkpoint) runs a checkpointed forward again during
backward. The recording of a checkpointed model is the recording of the same model without
checkpointing: the same steps (a recomputation is not a call), the same links, bit-identical
tensors; and its backward steps replay."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import recorder
import replayer
from tests.models import TinyGPT, train_step
from tests.recorder.readback import raw, step_rows

ITERATIONS = 3


class CheckpointedGPT(TinyGPT):
    """TinyGPT whose blocks run under activation checkpointing; ``how`` picks the variant."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.h:
            if self.how == "reentrant":
                x = checkpoint(block, x, use_reentrant=True)
            elif self.how == "non-reentrant":
                x = checkpoint(block, x, use_reentrant=False)
            elif self.how == "through a lambda":  # the region is not a step: its first step is inside
                x = checkpoint(lambda t, b=block: b(t) * 1.0, x, use_reentrant=True)
            else:
                x = block(x)
        return self.head(self.ln(x))


def record(path, how: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = CheckpointedGPT(how)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with recorder.record(path, model=model, optimizer=opt, mode="full") as run:
        losses = [train_step(model, opt, i) for i in range(ITERATIONS)]
    assert run.status == "complete" and run.failure is None
    return losses + [p.detach().clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    path = tmp_path_factory.mktemp("plain") / "run.zarr"
    results = record(path, "plain")
    return path, results, step_rows(path)


@pytest.mark.parametrize("how", ["reentrant", "non-reentrant", "through a lambda"])
def test_a_checkpointed_model_records_as_the_same_model_without_checkpointing(plain, tmp_path, how):
    """No recomputation shows as a step (nor as an exception: non-reentrant checkpointing stops its
    recomputations early by raising inside them); each call has one backward, linked to it, with
    the gradients the model without checkpointing has, bit for bit; training is unchanged."""
    _, plain_results, plain_steps = plain
    path = tmp_path / "run.zarr"
    results = record(path, how)
    for got, want in zip(results, plain_results, strict=True):
        assert raw(got) == raw(want)
    got_steps = step_rows(path)
    assert len(got_steps) == len(plain_steps) == ITERATIONS * 12
    for got, want in zip(got_steps, plain_steps, strict=True):
        assert got == want


def test_a_recorded_backward_of_a_reentrant_checkpoint_replays(tmp_path):
    """The backward of a call whose graph only its recomputation had replays bit for bit."""
    import replayer

    path = tmp_path / "run.zarr"
    record(path, "reentrant")
    rec = replayer.open(path)
    backward = rec.steps.filter(name="Block", phase="backward", iteration=1)
    assert len(backward) == 2
    for step in backward:
        assert step.forward is not None and rec.step(step.forward).module_path == step.module_path
        assert {r.role for r in step.records} >= {"grad_output", "grad_input", "param_grad"}
        assert replayer.replay(rec, step.index).match
    # The steps inside a block: their forward first ran without grad (the checkpoint's own forward),
    # so their inputs were recorded not requiring it; their backward (from the recomputation) replays.
    inner = [s for s in rec.steps.filter(phase="backward", iteration=1) if s.name != "Block"]
    assert inner and any(r.role == "grad_input" for s in inner for r in s.records)
    for step in inner:
        result = replayer.replay(rec, step.index)
        assert result.match, (step.selector, [d.summary() for d in result.outputs if not d.match])


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)])

    def forward(self, x: torch.Tensor, reentrant: bool) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=reentrant)
        return x.sum()


@pytest.mark.parametrize("reentrant", [True, False])
def test_modules_selected_by_glob_under_checkpointing(tmp_path, reentrant):
    """Modules recorded through global hooks (--modules): one forward and one backward per call,
    with its parameter grads, whichever checkpointing variant."""
    torch.manual_seed(0)
    model = Plain()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "run.zarr"
    with recorder.record(path, model=model, optimizer=opt, mode="full", modules=["blocks.*"]):
        for _ in range(2):
            model(torch.randn(4, 8, requires_grad=True), reentrant).backward()
            opt.step()
            opt.zero_grad()
    got = step_rows(path)
    forward = [(s["iteration"], s["path"], s["call"]) for s in got if s["phase"] == 0]
    backward = [(s["iteration"], s["path"], s["call"]) for s in got if s["phase"] == 1]
    assert forward == [(i, f"blocks.{b}", b) for i in range(2) for b in range(3)]
    assert backward == [(i, f"blocks.{b}", b) for i in range(2) for b in (2, 1, 0)]
    assert all(s["status"] == 0 for s in got)
    for s in got:
        if s["phase"] == 1:
            assert {name for role, name, *_ in s["tensors"] if role == "param_grad"} == {"0.weight", "0.bias"}
            assert got[s["forward"]]["path"] == s["path"]


@recorder.paper_step("Eq. 4", description="a block that checkpoints its own inner layers")
class SelfCheckpointing(nn.Module):
    """Checkpoints its inner layers in its own forward, the checkpoint function kept as an attribute
    (``functools.partial(checkpoint, use_reentrant=...)``, as Hugging Face's layers keep it) or
    called directly."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
        self.reentrant = reentrant
        self.kept = False

    def keep_checkpoint_function(self) -> None:  # after construction, as gradient_checkpointing_enable() does
        self.kept = True
        self.checkpoint_func = functools.partial(checkpoint, use_reentrant=self.reentrant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kept:
            return x + self.checkpoint_func(self.inner, x)
        return x + checkpoint(self.inner, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("kept", [True, False], ids=["kept as an attribute", "called"])
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_a_step_that_checkpoints_inside_itself_replays_forward_and_backward(tmp_path, reentrant, kept):
    """A step whose own code runs torch.utils.checkpoint: its module is rebuilt with the checkpoint
    function it keeps, and its backward replays bit for bit in both variants (the reentrant one
    refuses torch.autograd.grad)."""
    import replayer

    torch.manual_seed(0)
    model = nn.Sequential(SelfCheckpointing(reentrant), nn.Linear(8, 1))
    if kept:
        model[0].keep_checkpoint_function()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "run.zarr"
    with recorder.record(path, model=model, optimizer=opt, mode="full"):
        for _ in range(ITERATIONS):
            model(torch.randn(4, 8, requires_grad=True)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    rec = replayer.open(path)
    steps = rec.steps.filter(name="SelfCheckpointing")
    assert [s.phase for s in steps] == ["forward", "backward"] * ITERATIONS
    for step in steps:
        result = replayer.replay(rec, step.index)
        assert result.match, [d.summary() for d in result.outputs if not d.match]
        if step.phase == "backward":
            assert {d.name for d in result.outputs} >= {"inner.0.weight", "inner.2.weight"}
            assert all(d.mismatched == 0 and d.reason is None for d in result.outputs)


class InsideAndOut(nn.Module):
    """One layer called inside a reentrant checkpoint, then again outside it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.out = nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.a, x, use_reentrant=True)
        return self.out(h + self.a(h))


def test_a_layer_called_inside_a_reentrant_checkpoint_and_outside_replays(tmp_path):
    """The checkpointed call's parameter grads come from the recomputation's own backward: they are
    that call's share, found in the recomputed graph, not a total over both calls (which a replay
    of the two calls together compared: 6 false MISMATCHes)."""
    torch.manual_seed(0)
    model = InsideAndOut()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "run.zarr"
    with recorder.record(path, model=model, optimizer=opt, mode="full", modules=["a"]):
        for _ in range(2):
            model(torch.randn(3, 4, requires_grad=True)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    rec = replayer.open(path)
    backs = [s for s in rec.steps if s.phase == "backward"]
    assert len(backs) == 4 and all(s.extra.get("own_grads") == ["bias", "weight"] for s in backs)
    results = [replayer.replay(rec, s.index) for s in rec.steps]
    assert all(r.match for r in results), [(r.step.index, [d.summary() for d in r.outputs if not d.match])
                                          for r in results if not r.match]


# -- saved-tensor hooks ---------------------------------------------------------------------------
def pack_half(t: torch.Tensor) -> torch.Tensor:
    """A loop's memory trick: the activations the forward saves are kept in float16 (lossy)."""
    return t.to(torch.float16) if t.dtype == torch.float32 else t


def unpack_half(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32) if t.dtype == torch.float16 else t


@recorder.paper_step("Eq. 5", description="a gated block whose energy term overflows float16")
class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = (x * x).sum(-1, keepdim=True)
        return x + torch.tanh(self.fc(self.ln(x))) * torch.sigmoid(e - e.mean())


def _packed_training(path, trick: str, scale: float = 1.0) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(Gated(), Gated(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    grads = []
    with recorder.record(path, model=model, optimizer=opt, mode="full"):
        for i in range(2):
            x = torch.randn(6, 8) * (scale if i == 1 else 1.0)
            x.requires_grad_(trick == "checkpointed reentrant")
            if trick == "save_on_cpu":
                hooks = torch.autograd.graph.save_on_cpu(pin_memory=False)
            else:  # (a lambda: no name a replay could find it by)
                hooks = torch.autograd.graph.saved_tensors_hooks(
                    (lambda t: t.to(torch.float16)) if trick == "lambda" else pack_half, unpack_half)
            with hooks:
                if trick in ("save_on_cpu", "checkpointed", "checkpointed reentrant"):
                    out = checkpoint(model, x, use_reentrant=trick == "checkpointed reentrant")
                else:
                    out = model(x)
            out.pow(2).mean().backward()
            grads += [p.grad.clone() for p in model.parameters()]
            opt.step()
            opt.zero_grad()
    return grads


def test_saved_tensor_hooks_set_around_the_forward_are_applied_again_by_a_replay(tmp_path):
    """The loop packs what the forward saves to float16: the recorded backward steps read the packed
    values. The hooks are recorded with each call (the script's own functions, by import reference) and
    a replay applies them again around the forward: every backward replays bit for bit (before: every
    one a MISMATCH of ~1e-4, with no cause named)."""
    import replayer

    path = tmp_path / "run.zarr"
    _packed_training(path, "named")
    rec = replayer.open(path)
    assert rec.step(0).extra["saved_tensors_hooks"] == {
        "pack": {"ref": f"{__name__}:pack_half", "file": __file__},
        "unpack": {"ref": f"{__name__}:unpack_half", "file": __file__}}
    for step in rec.steps:
        result = replayer.replay(rec, step.index)
        assert result.match, (step.selector, [d.summary() for d in result.outputs if not d.match])


def test_saved_tensor_hooks_a_replay_cannot_apply_are_named_as_the_likely_cause(tmp_path):
    import replayer

    path = tmp_path / "run.zarr"
    _packed_training(path, "lambda")
    rec = replayer.open(path)
    back = rec.steps.filter(name="Gated", phase="backward")[0]
    result = replayer.replay(rec, back.index)
    assert not result.match
    assert any(w.startswith(f"the recorded call ran under saved-tensor hooks set outside it (torch.autograd.graph."
                            f"saved_tensors_hooks: pack {__name__}:_packed_training.<locals>.<lambda>, unpack "
                            f"{__name__}:unpack_half), which the replay could not apply (") and
               w.endswith("(a likely cause of any difference)") for w in result.warnings), result.warnings


@pytest.mark.parametrize("reentrant", [False, True])
def test_saved_tensor_hooks_set_outside_a_checkpoint_are_named_in_its_backward_replay(tmp_path, reentrant):
    """The loop packs saved activations to float16 around a checkpointed model: the checkpoint saves the
    input it recomputes from through those hooks, and the backward recomputes the blocks from what they
    made of it (either variant). A replay of a block alone cannot redo that: its backward differs, and says
    why (before: no hooks were recorded, and every backward step was a MISMATCH with no warning)."""
    path = tmp_path / "run.zarr"
    _packed_training(path, "checkpointed reentrant" if reentrant else "checkpointed")
    rec = replayer.open(path)
    first = rec.steps.filter(name="Gated", phase="forward")[0]
    assert first.extra["saved_tensors_hooks"] == {
        "pack": {"ref": f"{__name__}:pack_half", "file": __file__},
        "unpack": {"ref": f"{__name__}:unpack_half", "file": __file__}, "checkpoint": True}
    assert replayer.replay(rec, first.index).match
    back = rec.steps.filter(name="Gated", phase="backward")[-1]
    result = replayer.replay(rec, back.index)
    assert any(w.startswith("the recorded call ran inside activation checkpointing under saved-tensor hooks set "
                            f"outside it (torch.autograd.graph.saved_tensors_hooks: pack {__name__}:pack_half, "
                            f"unpack {__name__}:unpack_half)") for w in result.warnings), result.warnings


def test_save_on_cpu_and_checkpointing_hooks_need_nothing_applied(tmp_path):
    """torch's own saved-tensor hooks: save_on_cpu's (lossless) and non-reentrant checkpointing's inside
    it (its recomputation: not recorded as hooks of the call)."""
    import replayer

    path = tmp_path / "run.zarr"
    _packed_training(path, "save_on_cpu")
    rec = replayer.open(path)
    assert all("saved_tensors_hooks" not in s.extra for s in rec.steps)
    for step in rec.steps:
        result = replayer.replay(rec, step.index)
        assert result.match and not any("saved-tensor" in w for w in result.warnings), step.selector


def test_a_nan_the_packing_made_is_found_at_the_pack_hooks_line(tmp_path):
    """float16 packing overflows (the forward in float32 is finite): the block's backward makes NaN of the
    Inf it reads. The operation is the packing's cast, at its line, from a replay that reproduced the
    step (before: "the replay did not reproduce the recorded step ... the code may not be the recorded
    run's")."""
    import replayer

    path = tmp_path / "run.zarr"
    grads = _packed_training(path, "named", scale=1e5)
    assert not all(torch.isfinite(g).all() for g in grads)
    origin = replayer.first_nonfinite(replayer.open(path), ops=True)
    assert origin.step is not None and (origin.step.name, origin.step.phase) == ("Gated", "backward"), origin.cause
    assert origin.op is not None, origin.op_note
    assert "did not reproduce" not in (origin.op_note or ""), origin.op_note
    assert "t.to(torch.float16)" in f"{origin.op.code} {origin.op_note}", (origin.op, origin.op_note)
