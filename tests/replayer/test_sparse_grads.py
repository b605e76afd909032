"""Sparse gradients (nn.Embedding(sparse=True)'s weight grad) keep their parts, indices and values, where
the step keeps payloads (full mode, flight mode's ring; schema 1.24), as a sparse argument or result does:
a backward replay compares them bit for bit, and an edited grad output shows the difference. Recording
leaves training as it is (SGD and SparseAdam on sparse grads). An older recording, which kept their
statistics only, replays as before: the sparse gradient is not compared, saying why."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

import recorder
import replayer
from recorder.errors import ReplayError
from tests.cli import pdbg_here
from tests.replayer.test_sparse import Embed, _same_sparse

TOKENS = [torch.tensor([[1, 2, 2, 7]]), torch.tensor([[3, 3, 0, 1]]), torch.tensor([[9, 2, 5, 2]])]


def _train(path: Path | None, mode: str = "full", optimizer: str = "sgd", **options: object,
           ) -> tuple[Embed, list[torch.Tensor]]:
    """Three iterations of ``Embed`` (an embedding with sparse=True, then a projection), recorded at ``path``
    (None: not recorded); returns the model and the embedding's sparse weight grad of each iteration."""
    torch.manual_seed(0)
    model = Embed()
    if optimizer == "sgd":
        opts: list[torch.optim.Optimizer] = [torch.optim.SGD(model.parameters(), lr=0.1)]
    else:  # (SparseAdam takes sparse gradients only: the projection's dense ones go to Adam)
        opts = [torch.optim.SparseAdam(list(model.table.parameters()), lr=0.1),
                torch.optim.Adam(model.proj.parameters(), lr=0.1)]
    grads = []
    with recorder.record(path, model=model, optimizer=opts[0], mode=mode, **options) if path is not None else \
            contextlib.nullcontext():
        for tokens in TOKENS:
            model(tokens).sum().backward()
            grads.append(model.table.weight.grad.detach().clone())
            for opt in opts:
                opt.step()
                opt.zero_grad()
    return model, grads


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.int32)


@pytest.mark.parametrize("optimizer", ["sgd", "sparse_adam"])
@pytest.mark.parametrize("mode", ["full", "flight"])
def test_a_sparse_gradient_keeps_its_parts_and_its_backward_replays_bit_for_bit(
        tmp_path: Path, mode: str, optimizer: str) -> None:
    """The embedding's weight grad of the module's backward step has its component records (indices and
    values as autograd held them, uncoalesced), which make it again bit for bit; a replay of the backward
    compares it by them, bit for bit, not by statistics (before: "not compared", statistics only); and
    training is what it is without recording."""
    options = {"keep": 2} if mode == "flight" else {}
    model, grads = _train(tmp_path / "run.zarr", mode, optimizer, **options)
    plain, plain_grads = _train(None, optimizer=optimizer)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(model.parameters(), plain.parameters(), strict=True))
    assert all(_same_sparse(a, b) for a, b in zip(grads, plain_grads, strict=True))
    rec = replayer.open(tmp_path / "run.zarr")
    backward = [s for s in rec.steps.filter(phase="backward") if s.name == "Embed"]
    kept = backward[1:] if mode == "flight" else backward
    assert [s.iteration for s in kept] == ([1, 2] if mode == "flight" else [0, 1, 2])
    for step in kept:
        table = next(r for r in step.records if r.name == "table.weight")
        assert table.role == "param_grad" and not table.has_payload and step.holds_values(table)
        assert step.extra["sparse"]["table.weight"] == {
            "layout": "sparse_coo", "values": 12, "coalesced": False,
            "parts": {"indices": "table.weight:indices", "values": "table.weight:values"}}
        assert [(r.role, r.name, r.has_payload) for r in step.records if r.role == "component"] == [
            ("component", "table.weight:indices", True), ("component", "table.weight:values", True)]
        assert _same_sparse(step.tensor("table.weight"), grads[step.iteration])
        result = replayer.replay(rec, step.index)
        assert result.match and result.by_statistics == [] and not any("not compared" in w for w in result.warnings)
        diff = next(d for d in result.outputs if d.name == "table.weight")
        assert (diff.role, diff.reason, diff.measured, diff.mismatched) == ("param_grad", None, True, 0)
        assert {d.name for d in result.outputs} == {"proj.weight", "proj.bias", "table.weight"}
    res = pdbg_here("replay", str(tmp_path / "run.zarr"), str(kept[-1].index), cwd=tmp_path)
    assert res.returncode == 0 and "MATCH: bit for bit" in res.stdout and "statistics" not in res.stdout, res.stdout


def test_an_embedding_step_replays_its_sparse_gradient_and_an_edit_shows_the_difference(tmp_path: Path) -> None:
    """The embedding recorded as a step of its own: its backward step's only gradient is the sparse weight
    grad, which a replay compares bit for bit (before: refused, "nothing a replay could compare"), as the
    replay of the module around it compares it there; a grad output edited to twice its values gives a
    weight grad whose values differ, at the same indices."""
    _train(tmp_path / "run.zarr", modules=["**"])
    rec = replayer.open(tmp_path / "run.zarr")
    step = next(s for s in rec.steps.filter(phase="backward") if s.name == "Embedding")
    assert [(r.role, r.name) for r in step.records] == [
        ("grad_output", "output"), ("param_grad", "weight"), ("component", "weight:indices"),
        ("component", "weight:values")]
    result = replayer.replay(rec, step.index)
    assert result.match and [(d.name, d.reason, d.measured, d.mismatched) for d in result.outputs] == [
        ("weight", None, True, 0)]
    res = pdbg_here("replay", str(tmp_path / "run.zarr"), str(step.index), cwd=tmp_path)
    assert res.returncode == 0 and "MATCH: bit for bit" in res.stdout, res.stdout
    outer = replayer.replay(rec, next(s for s in rec.steps.filter(phase="backward") if s.name == "Embed").index)
    assert outer.match and [(i.step.name, i.match) for i in outer.inner] == [("Linear", True), ("Embedding", True)]
    inner = next(d for i in outer.inner if i.step.name == "Embedding" for d in i.diffs if d.name == "weight")
    assert (inner.reason, inner.measured, inner.mismatched) == (None, True, 0)
    edited = replayer.replay(rec, step.index, edit={"grad_output:output": "x * 2"})
    diff = edited.outputs[0]
    assert not edited.match and diff.name == "weight" and diff.reason is None and diff.measured
    recorded = step.tensor("weight")
    assert diff.mismatched == recorded._values().numel()
    assert diff.max_abs_diff == pytest.approx(recorded._values().abs().max().item())


def test_a_sparse_gradient_of_an_older_recording_is_left_out_as_before(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A recording before schema 1.24 kept a sparse gradient's statistics only: a backward replay compares
    the dense gradients and says why the sparse one is not compared; the embedding's own backward step,
    with nothing else to compare, is refused in one line."""
    from recorder import capture
    from tests.sealing import as_schema

    with monkeypatch.context() as patched:  # (what a 1.23 recorder kept)
        patched.setattr(capture, "_SPARSE_PARTS_KEPT", frozenset({"input", "output", "param", "buffer"}))
        _train(tmp_path / "run.zarr", modules=["**"])
    as_schema(tmp_path / "run.zarr", "1.23")
    rec = replayer.open(tmp_path / "run.zarr")
    assert not [r for s in rec.steps.filter(phase="backward") for r in s.records if r.role == "component"]
    why = "its indices and values were not kept: a recording before schema 1.24 keeps statistics of a sparse " \
          "gradient's stored values only"
    embedding = next(s for s in rec.steps.filter(phase="backward") if s.name == "Embedding")
    with pytest.raises(ReplayError, match=r"has nothing a replay could compare: param_grad weight \(torch\.sparse_coo "
                                          r"tensor on cpu: metadata only; .*" + why):
        replayer.replay(rec, embedding.index)
    step = next(s for s in rec.steps.filter(phase="backward") if s.name == "Embed")
    result = replayer.replay(rec, step.index, nested=False)
    assert result.match and {d.name for d in result.outputs} == {"proj.weight", "proj.bias"}
    assert any(w.startswith("not compared: param_grad table.weight (torch.sparse_coo tensor") and w.endswith(why + ")")
               for w in result.warnings), result.warnings
