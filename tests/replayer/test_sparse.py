"""Sparse gradients (nn.Embedding(sparse=True)) are recorded with the statistics of the values they store:
a NaN in one is found; a backward replay compares them with the dense gradients (test_sparse_grads.py).
A step's sparse arguments and results (a GCN's adjacency) keep their parts (indices and values) where
the step keeps payloads: a replay gives the step its adjacency again and compares a sparse result bit
for bit; without them (stats mode, older recordings), a result is compared by its statistics.
Nested tensors (torch.nested, jagged and strided) and tensors the recorder cannot read are records
of statistics too, and the recording goes on; a step given one is listed as not replayable, with why.
Tensor subclasses (a fixed-point tensor) are recorded with their class, and a replay makes them again."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import recorder
import replayer
from recorder.errors import ReplayError
from replayer.bundles import BundleError
from tests.cli import pdbg_here
from tui import views


@recorder.paper_step("Eq. 8", description="embed tokens, then project")
class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(10, 4, sparse=True)
        self.proj = nn.Linear(4, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.proj(self.table(tokens))


def test_sparse_gradients_have_statistics_and_replay_with_dense_ones(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Embed()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.tensor([[1, 2, 2, 7]])
    with recorder.record(tmp_path / "run.zarr", model=model, optimizer=opt, mode="full") as run:
        for _ in range(2):
            model(tokens).sum().backward()
            opt.step()
            opt.zero_grad()
    assert run.status == "complete"
    rec = replayer.open(tmp_path / "run.zarr")
    backward = rec.steps.filter(phase="backward")[0]
    table = next(r for r in backward.records if r.name == "table.weight")
    assert table.role == "param_grad" and not table.has_payload
    # the rows it stores: token 2's summed over its two places, tokens 1 and 7
    rows = backward.tensor("output")[0] @ rec.step(backward.forward).tensor("proj.weight")
    stored = torch.stack([rows[0], rows[1] + rows[2], rows[3]])
    assert (table.stats["min"], table.stats["max"], table.stats["nan"]) == (stored.min().item(),
                                                                           stored.max().item(), 0)
    result = replayer.replay(rec, backward.index)
    assert result.match and result.by_statistics == []
    assert {d.name for d in result.outputs} == {"proj.weight", "proj.bias", "table.weight"}
    assert not any(w.startswith("not compared") for w in result.warnings)


def test_an_inf_born_in_a_sparse_gradient_is_found(tmp_path: Path) -> None:
    table = nn.Embedding(10, 4, sparse=True)
    opt = torch.optim.SGD(table.parameters(), lr=0.0)
    tokens = torch.tensor([2, 5, 2])
    with recorder.record(tmp_path / "run.zarr", model=table, optimizer=opt, mode="full", modules=["**"]):
        for scale in (1.0, 1.0, 3e38):  # token 2's two rows of 3e38 sum to inf, from finite grad outputs
            (table(tokens) * scale).sum().backward()
            opt.step()
            opt.zero_grad()
    rec = replayer.open(tmp_path / "run.zarr")
    backward = rec.steps.filter(phase="backward")
    assert [s.status for s in backward] == ["ok", "ok", "nonfinite"]
    origin = replayer.first_nonfinite(rec)
    assert origin.step is not None and origin.step.index == backward[2].index
    assert "param_grad weight" in origin.cause and "Inf" in origin.cause


@recorder.paper_step("Eq. 1", description="an ordinary step")
def _project(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w


@recorder.paper_step("Eq. 3", description="mean over a nested tensor of variable-length sequences")
def _pool_nested(nt: torch.Tensor) -> torch.Tensor:
    return torch.stack([t.mean(0) for t in nt.unbind()])


def _nested_run(path: Path, layout: torch.layout, nested_at: int = 0) -> list[torch.Tensor]:
    """Four iterations of an ordinary step, and in iteration ``nested_at`` a step given a nested tensor
    (the first step of the run when 0); returns the nested tensor's parts."""
    torch.manual_seed(0)
    w = torch.randn(4, 4, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    parts = [torch.randn(3, 4), torch.randn(5, 4)]
    with recorder.record(path, optimizer=opt, mode="full") as run:
        for it in range(4):
            y = torch.zeros(())
            if it == nested_at:
                y = y + _pool_nested(torch.nested.nested_tensor(parts, layout=layout)).sum()
            y = y + _project(torch.randn(2, 4), w).sum()
            y.backward()
            opt.step()
            opt.zero_grad()
    assert run.status == "complete"
    return parts


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("layout", [torch.jagged, torch.strided], ids=["jagged", "strided"])
def test_a_nested_tensor_keeps_its_statistics_and_the_recording_goes_on(tmp_path: Path, layout: torch.layout) -> None:
    """A torch.nested tensor given to a step stopped the recording: the jagged layout's symbolic size
    (j1) failed the writer, the whole recording lost when it came in iteration 0; the strided layout,
    which has no sizes, failed capture, and its step was kept with no arguments. It is a record of
    statistics, its ragged dimension -1 in its shape and its sizes in a note, and every step after it
    is recorded."""
    parts = _nested_run(tmp_path / "run.zarr", layout)
    rec = replayer.open(tmp_path / "run.zarr")
    assert rec.status == "complete"
    assert [(s.name, s.iteration) for s in rec.steps.filter(phase="forward")] == \
        [("_pool_nested", 0), ("_project", 0), ("_project", 1), ("_project", 2), ("_project", 3)]
    step = rec.steps.filter(name="_pool_nested")[0]
    record = next(r for r in step.records if r.role == "input")
    assert (record.name, record.shape, record.dtype, record.has_payload) == ("args.0", (2, -1, 4), "float32", False)
    values = torch.cat([p.reshape(-1) for p in parts])
    assert (record.stats["min"], record.stats["max"], record.stats["absmax"], record.stats["nan"]) == \
        (values.min().item(), values.max().item(), values.abs().max().item(), 0)
    assert step.why_statistics_only(record).startswith(
        f"nested tensor ({str(layout).removeprefix('torch.')} layout) of 2 tensors of sizes (3, 4), (5, 4) on cpu: "
        "metadata only")
    assert step.tensor("output").shape == (2, 4)
    assert not any(layout_note.startswith("capture failed") for layout_note in step.extra.get("notes", []))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("layout", [torch.jagged, torch.strided], ids=["jagged", "strided"])
def test_a_step_given_a_nested_tensor_is_listed_as_not_replayable(tmp_path: Path, layout: torch.layout) -> None:
    """`pdbg verify` replayed the strided-nested step with no arguments (a TypeError, "7 of 8", exit 1)
    and `pdbg replay` printed MISMATCH: the step is one a replay cannot redo, listed with why, and the
    others replay bit for bit."""
    _nested_run(tmp_path / "run.zarr", layout, nested_at=1)
    rec = replayer.open(tmp_path / "run.zarr")
    step = rec.steps.filter(name="_pool_nested")[0]
    with pytest.raises(ReplayError, match=r"kept statistics only for input args\.0 \(nested tensor"):
        replayer.replay(rec, step.index)
    res = pdbg_here("verify", str(tmp_path / "run.zarr"), "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert (doc["mismatches"], doc["matched"], doc["replayed"]) == ([], 8, 8)
    assert [m["step"]["index"] for m in doc["not_replayed"]] == [step.index]
    assert "nested tensor" in doc["not_replayed"][0]["reason"]
    assert "statistics_only" not in doc


class _Unreadable(torch.Tensor):
    """A tensor subclass whose values cannot be taken out of autograd (as some wrappers refuse)."""

    def detach(self) -> torch.Tensor:  # type: ignore[override]
        raise RuntimeError("this wrapper cannot be detached")


@recorder.paper_step("Eq. 4", description="scale")
def _scale(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x.as_subclass(torch.Tensor) * 2 + y


def test_a_tensor_the_recorder_cannot_read_degrades_its_record_not_the_recording(tmp_path: Path) -> None:
    """Any failure to capture one tensor stopped the whole recording ("PaperDebugger stopped recording",
    the run incomplete): that tensor's record keeps what could be read, a note says why, and the step
    and the run go on."""
    with pytest.warns(recorder.RecorderWarning, match=r"could not capture args\.0 of _scale \(_Unreadable; "
                                                      r"RuntimeError: this wrapper cannot be detached\)"):
        with recorder.record(tmp_path / "run.zarr", mode="full") as run:
            for _ in range(2):
                _scale(torch.ones(3).as_subclass(_Unreadable), torch.zeros(3))
                run.next_iteration()
    assert run.status == "complete"
    rec = replayer.open(tmp_path / "run.zarr")
    assert len(rec.steps) == 2
    step = rec.step(0)
    odd = next(r for r in step.records if r.name == "args.0")
    assert (odd.shape, odd.has_payload) == ((3,), False)
    assert step.why_statistics_only(odd) == ("_Unreadable that could not be captured (RuntimeError: this wrapper "
                                             "cannot be detached): metadata only, without statistics")
    assert torch.equal(step.tensor("args.1"), torch.zeros(3)) and torch.equal(step.tensor("output"), 2 * torch.ones(3))
    with pytest.raises(ReplayError, match=r"kept only the shape and dtype of input args\.0, no values or statistics "
                                          r"\(_Unreadable that could not be captured"):
        replayer.replay(rec, 0)  # (it once said "kept statistics only" of a record without them)


def test_a_step_whose_capture_failed_is_not_replayed_without_its_arguments(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A step whose capture failed (the recorder stops there) was replayed with no arguments: a TypeError
    reported as a MISMATCH. A replay refuses it and says why."""
    from recorder import capture

    def broken() -> list[str]:
        raise RuntimeError("hooks unreadable")

    with pytest.warns(recorder.RecorderWarning, match="PaperDebugger stopped recording"):
        with recorder.record(tmp_path / "run.zarr", mode="full") as run:
            _project(torch.ones(2, 4), torch.ones(4, 4))
            run.next_iteration()
            monkeypatch.setattr(capture.skeleton, "global_hooks", broken)
            _project(torch.ones(2, 4), torch.ones(4, 4))
    rec = replayer.open(tmp_path / "run.zarr")
    assert len(rec.steps) == 2 and rec.status == "incomplete"
    with pytest.raises(ReplayError, match=r"the recorder failed to capture this call \(RuntimeError: hooks "
                                          r"unreadable\) and stopped recording there; it cannot be replayed"):
        replayer.replay(rec, 1)
    res = pdbg_here("verify", str(tmp_path / "run.zarr"), "--json", cwd=tmp_path)
    doc = json.loads(res.stdout)
    assert (res.returncode, doc["matched"], doc["mismatches"]) == (0, 1, [])
    assert [m["step"]["index"] for m in doc["not_replayed"]] == [1]


@recorder.paper_step("Eq. 5", description="scale a nested tensor")
def _scale_nested(nt: torch.Tensor) -> torch.Tensor:
    return nt * 2.0


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("layout", [torch.jagged, torch.strided], ids=["jagged", "strided"])
def test_a_nested_tensor_that_requires_grad_is_recorded_through_its_backward(tmp_path: Path,
                                                                            layout: torch.layout) -> None:
    """A strided nested tensor that requires grad was followed for gradients like a strided tensor,
    which has one shape, and the tap failed: the recording stopped. Nested tensors are not followed;
    the forward steps, their outputs and the backward of the step after them are recorded."""
    a, b = torch.randn(3, 4, requires_grad=True), torch.randn(5, 4, requires_grad=True)
    opt = torch.optim.SGD([a, b], lr=0.1)
    first = torch.cat([a.detach().reshape(-1), b.detach().reshape(-1)])
    with recorder.record(tmp_path / "run.zarr", optimizer=opt, mode="full") as run:
        for _ in range(2):
            nt = torch.nested.as_nested_tensor([a * 1, b * 1], layout=layout)
            _pool_nested(_scale_nested(nt)).sum().backward()
            opt.step()
            opt.zero_grad()
    assert run.status == "complete"
    rec = replayer.open(tmp_path / "run.zarr")
    assert [(s.name, s.phase) for s in rec.steps.filter(iteration=1)] == \
        [("_scale_nested", "forward"), ("_pool_nested", "forward"), ("_pool_nested", "backward")]
    out = next(r for r in rec.steps.filter(name="_scale_nested")[0].records if r.role == "output")
    assert (out.shape, out.has_payload) == ((2, -1, 4), False)
    assert (out.stats["min"], out.stats["max"]) == ((2 * first).min().item(), (2 * first).max().item())


class Fixed(torch.Tensor):
    """A simulated fixed-point tensor (quantisation-simulation code): every result of an operation is
    rounded to a grid of 1/16, and an instance's ``gain`` (an attribute, not a class default) scales
    what the steps below make of it."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        out = super().__torch_function__(func, types, args, kwargs or {})
        if isinstance(out, Fixed) and out.is_floating_point() and getattr(func, "__name__", "") not in (
                "detach", "__get__"):
            with torch._C.DisableTorchFunctionSubclass():
                out = (torch.round(out * 16) / 16).as_subclass(Fixed)
        return out


def fixed(t: torch.Tensor, gain: float) -> Fixed:
    out = t.as_subclass(Fixed)
    out.gain = gain
    return out


@recorder.paper_step("Eq. 9", description="a fixed-point affine step")
def _affine(x: torch.Tensor, a: float) -> torch.Tensor:
    return torch.tanh(x * a + 0.11) * x.gain


@recorder.paper_step("Eq. 10", description="a fixed-point block")
class _FixedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.fc(x))


def _fixed_training(path: Path | None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    block = _FixedBlock()
    opt = torch.optim.SGD(block.parameters(), lr=0.1)
    seen = []
    with recorder.record(path, model=block, optimizer=opt, mode="full") if path else contextlib.nullcontext():
        for _ in range(2):
            y = _affine(fixed(torch.randn(5, 4, requires_grad=True), gain=3.0), 0.37)
            z = block(y)
            assert type(y) is Fixed and type(z) is Fixed
            z.sum().as_subclass(torch.Tensor).backward()
            opt.step()
            opt.zero_grad()
            seen += [y.as_subclass(torch.Tensor).detach(), z.as_subclass(torch.Tensor).detach()]
    return seen


def test_a_tensor_subclass_argument_is_made_again_by_a_replay(tmp_path: Path) -> None:
    """A step given a fixed-point tensor subclass (its ``__torch_function__`` rounds every result): a
    replay gave it a plain tensor, and 3 of the 6 steps matched, with errors up to 1e9 ULP and no
    warning. The recording names the class and the instance's attributes (the step's extra
    ``subclasses``), a replay makes the argument an instance of it again, with its attributes, and
    every step replays bit for bit; training sees what it sees unrecorded (the class and attribute of
    what a step is given: the recorder's tap once gave a step an argument that requires grad without its
    instance attributes, and the recorded training raised AttributeError)."""
    plain = _fixed_training(None)
    seen = _fixed_training(tmp_path / "run.zarr")
    assert [t.view(torch.int32).tolist() for t in seen] == [t.view(torch.int32).tolist() for t in plain]
    rec = replayer.open(tmp_path / "run.zarr")
    first = rec.step(0)
    assert first.extra["subclasses"] == {"args.0": {"type": f"{__name__}:Fixed", "attrs": {"gain": 3.0}},
                                         "output": {"type": f"{__name__}:Fixed"}}
    for step in rec.steps:
        result = replayer.replay(rec, step.index)
        assert result.match, (step.index, [d.summary() for d in result.outputs])
        assert not any("subclass" in w for w in result.warnings)


def test_a_tensor_subclass_a_replay_cannot_make_is_named_as_the_likely_cause(tmp_path: Path) -> None:
    """A subclass defined inside a function, which a replay cannot import: the step is given a plain
    tensor, and the replay's warning names the class as the likely cause of the difference (it said
    nothing before)."""

    class Local(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
            out = super().__torch_function__(func, types, args, kwargs or {})
            if isinstance(out, Local) and getattr(func, "__name__", "") == "tanh":
                out = out + 1
            return out

    x = torch.randn(3).as_subclass(Local)
    x.gain = 1.0
    with recorder.record(tmp_path / "run.zarr", mode="full"):
        _affine(x, 1.0)
    rec = replayer.open(tmp_path / "run.zarr")
    result = replayer.replay(rec, 0)
    assert not result.match
    assert any(w.startswith(f"args.0 was a {__name__}:test_a_tensor_subclass_a_replay_cannot_make_is_named_as_the_"
                            "likely_cause.<locals>.Local (a tensor subclass) when recorded, which the replay does "
                            "not make again") and "likely cause" in w for w in result.warnings), result.warnings


# -- sparse results (a GCN's normalised adjacency) and arguments (its adjacency given) ------------------------
_SCALE = 1.0  # what _sym_norm multiplies its weights by: a replay that reads another computes other values
_DENSE = False  # _sym_norm returns its adjacency dense: a replay that reads True returns another layout
# torch's warnings on making sparse tensors (invariant checks off, CSR in beta), not the tests' concern
_SPARSE_WARNINGS = pytest.mark.filterwarnings("ignore:Sparse invariant checks", "ignore:Sparse CSR tensor support",
                                              "ignore:Sparse BSR tensor support", "ignore:Sparse CSC tensor support",
                                              "ignore:Sparse BSC tensor support")
EDGES = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3], [0, 1, 2, 3, 1, 2, 3, 0]])  # (source, destination), self-loops


@recorder.paper_step("Eq. 11", description="A_hat = D^-1/2 A D^-1/2 from an edge list, sparse")
def _sym_norm(edge_index: torch.Tensor, n: int, kind: str = "coo") -> torch.Tensor:
    src, dst = edge_index
    dinv = torch.zeros(n).index_add_(0, dst, torch.ones(dst.numel())).rsqrt() * _SCALE
    a = torch.sparse_coo_tensor(torch.stack([dst, src]), dinv[src] * dinv[dst], (n, n)).coalesce()
    return a.to_dense() if _DENSE else a.to_sparse_csr() if kind == "csr" else a


def _same_sparse(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two sparse tensors are the same bit for bit: layout, dtype, shape, a COO tensor's coalesced
    flag, and each part (indices and values as they hold them) bitwise."""
    from recorder import payload

    pa, pb = payload.sparse_parts(a), payload.sparse_parts(b)
    return (a.layout, a.dtype, a.shape) == (b.layout, b.dtype, b.shape) and pa is not None and pb is not None and \
        (a.layout != torch.sparse_coo or a.is_coalesced() == b.is_coalesced()) and pa.keys() == pb.keys() and \
        all(bits_equal(pa[k], pb[k]) for k in pa)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of two strided tensors (NaN and signed zeros included)."""
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(width),
                                                                      b.contiguous().view(width))


@_SPARSE_WARNINGS
@pytest.mark.parametrize("kind", ["coo", "csr"])
def test_a_step_returning_a_sparse_tensor_replays_bit_for_bit(tmp_path: Path, kind: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A step returning a sparse tensor (a GCN's normalised adjacency) crashed `pdbg replay` and `pdbg
    verify` ("Cannot access data pointer of Tensor that doesn't have storage"), and was then compared by
    the statistics of its stored values only: its indices were not recorded, so values at other places
    matched. The recording keeps its parts (indices and values) where it keeps payloads, and a replay
    compares it bit for bit: other values, or another layout, a mismatch with the distance of its values."""
    with recorder.record(tmp_path / "run.zarr", mode="full") as run:
        for _ in range(2):
            made = _sym_norm(EDGES, 4, kind)
            run.next_iteration()
    rec = replayer.open(tmp_path / "run.zarr")
    step = rec.step(0)
    out = next(r for r in step.records if r.role == "output")
    assert (out.shape, out.has_payload, step.sparse(out)) == ((4, 4), False, (f"sparse_{kind}", 8))
    names = ("indices", "values") if kind == "coo" else ("crow_indices", "col_indices", "values")
    assert step.extra["sparse"] == {"output": {"layout": f"sparse_{kind}", "values": 8,
                                               "parts": {n: f"output:{n}" for n in names},
                                               **({"coalesced": True} if kind == "coo" else {})}}
    assert [(r.role, r.name) for r in step.records if r.role == "component"] == [("component", f"output:{n}")
                                                                                 for n in names]
    assert _same_sparse(step.tensor("output"), made) and step.holds_values(out)
    assert step.why_statistics_only(out).endswith("statistics of its 8 stored values (the zeros it does not store "
                                                  "left out)")
    result = replayer.replay(rec, 0)
    assert result.match and result.by_statistics == []
    diff = result.outputs[0]
    assert (diff.name, diff.reason, diff.measured, diff.mismatched) == ("output", None, True, 0)
    assert diff.recorded == diff.replayed and diff.recorded["max"] == made.values().max().item()
    res = pdbg_here("replay", str(tmp_path / "run.zarr"), "0", cwd=tmp_path)
    assert res.returncode == 0 and "MATCH: bit for bit" in res.stdout and "statistics" not in res.stdout, res.stdout
    res = pdbg_here("verify", str(tmp_path / "run.zarr"), "--json", cwd=tmp_path)
    doc = json.loads(res.stdout)
    assert (res.returncode, doc["matched"], doc["not_replayed"], "by_statistics" in doc) == (0, 2, [], False), \
        res.stdout
    monkeypatch.setattr(sys.modules[__name__], "_SCALE", 2.0)
    other = replayer.replay(rec, 0)
    assert not other.match and not other.by_statistics
    far = other.outputs[0]
    assert far.reason is None and far.mismatched == 8 and far.measured  # (each weight scaled by 2 * 2)
    assert far.max_abs_diff == pytest.approx(3 * made.values().max().item())
    assert far.replayed["max"] == pytest.approx(4 * made.values().max().item())
    monkeypatch.setattr(sys.modules[__name__], "_DENSE", True)
    dense = replayer.replay(rec, 0)
    assert not dense.match and dense.outputs[0].reason == f"layouts differ: recorded sparse_{kind}, replayed strided"


@recorder.paper_step("Eq. 15", description="a ring graph's adjacency, made from nothing the step is given")
def _ring(n: int, kind: str = "coo") -> torch.Tensor:
    ring = torch.stack([torch.arange(n), (torch.arange(n) + 1) % n])
    a = torch.sparse_coo_tensor(ring, torch.full((n,), 0.5) * _SCALE, (n, n)).coalesce()
    return a.to_sparse_csr() if kind == "csr" else a


def _without_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Record as a recorder before schema 1.19 did: a sparse tensor's statistics only, without its parts."""
    from recorder import capture

    monkeypatch.setattr(capture.payload_mod, "sparse_parts", lambda t: None)


@_SPARSE_WARNINGS
@pytest.mark.parametrize("kind", ["coo", "csr"])
@pytest.mark.parametrize("kept", ["stats", "1.18"])
def test_a_sparse_result_whose_parts_were_not_kept_is_compared_by_statistics_as_before(
        tmp_path: Path, kind: str, kept: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the recording holds no parts of a sparse result (stats mode; a recording before schema 1.19,
    which kept none), a replay compares it by the statistics of its stored values, as it did, and says
    so: a match by statistics, not bit for bit; other values, a mismatch."""
    from tests.sealing import as_schema

    with monkeypatch.context() as patched:
        if kept == "1.18":
            _without_parts(patched)
        with recorder.record(tmp_path / "run.zarr", mode="stats" if kept == "stats" else "full") as run:
            for _ in range(2):
                made = _ring(4, kind)
                run.next_iteration()
    if kept == "1.18":
        as_schema(tmp_path / "run.zarr", "1.18")
    rec = replayer.open(tmp_path / "run.zarr")
    step = rec.step(0)
    out = next(r for r in step.records if r.role == "output")
    assert step.extra["sparse"] == {"output": {"layout": f"sparse_{kind}", "values": 4}}
    assert step.sparse_parts(out) is None and not step.holds_values(out)
    assert not [r for r in step.records if r.role == "component"]
    result = replayer.replay(rec, 0)
    assert result.match and result.by_statistics == ["output"]
    diff = result.outputs[0]
    assert diff.reason == f"compared by statistics of its 4 stored values only (a sparse_{kind} tensor: its indices " \
                          "are not recorded)"
    assert diff.replayed == diff.recorded and diff.recorded["max"] == made.values().max().item() and not diff.measured
    res = pdbg_here("replay", str(tmp_path / "run.zarr"), "0", cwd=tmp_path)
    assert res.returncode == 0 and "MATCH: output by statistics only, not bit for bit" in res.stdout, res.stdout
    res = pdbg_here("verify", str(tmp_path / "run.zarr"), cwd=tmp_path)  # (its summary says which case this is)
    assert res.returncode == 0 and res.stdout.endswith(
        "2 of them by statistics only, not bit for bit: sparse results whose indices were not kept, compared by the "
        "statistics of their stored values\n"), res.stdout
    view = views.tensor_view(step, "output", "output")
    assert view.slice_text == (f"a sparse_{kind} tensor of 4 stored values: statistics of its stored values only (its "
                               "indices and values were not kept: " + (
                                   "the run was recorded in stats mode, which keeps statistics only)" if kept == "stats"
                                   else "a recording before schema 1.19 keeps statistics of a sparse tensor's stored "
                                   "values only)"))
    monkeypatch.setattr(sys.modules[__name__], "_SCALE", 2.0)
    other = replayer.replay(rec, 0)
    assert not other.match and not other.by_statistics


@recorder.paper_step("Eq. 12", description="H' = A_hat H W")
class _Propagate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        return torch.sparse.mm(_sym_norm(edge_index, x.shape[0]), self.lin(x))


@_SPARSE_WARNINGS
def test_a_step_whose_inner_step_returns_a_sparse_tensor_replays(tmp_path: Path) -> None:
    """Replaying an outer step crashed where an inner step returned a sparse tensor: its inner steps
    are compared, the sparse one bit for bit, and `pdbg verify` replays every step."""
    torch.manual_seed(0)
    layer = _Propagate()
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    with recorder.record(tmp_path / "run.zarr", model=layer, optimizer=opt, mode="full"):
        for _ in range(2):
            layer(torch.randn(4, 3), EDGES).sum().backward()
            opt.step()
            opt.zero_grad()
    rec = replayer.open(tmp_path / "run.zarr")
    result = replayer.replay(rec, "Eq. 12@iter=0")
    assert result.match and [s.step.name for s in result.inner] == ["_sym_norm"]
    assert result.by_statistics == [] and [(d.name, d.reason) for d in result.inner[0].diffs] == [("output", None)]
    assert result.outputs[0].reason is None and result.outputs[0].measured  # (its own output: bit for bit)
    res = pdbg_here("verify", str(tmp_path / "run.zarr"), "--json", cwd=tmp_path)
    doc = json.loads(res.stdout)
    assert (res.returncode, doc["mismatches"], doc["not_replayed"], doc["matched"], "by_statistics" in doc) == \
        (0, [], [], 6, False), res.stdout


@_SPARSE_WARNINGS
def test_a_sparse_result_made_non_finite_is_found_counted_and_bundled(tmp_path: Path) -> None:
    """The normalisation of a node without incoming edges puts 1/sqrt(0) = Inf into the sparse adjacency.
    Its NaN origin said "1 Inf of 16" (the dense size; the statistics are of the 6 values it stores);
    `bisect --ops`, `bundle --verify` and the bundle's replay crashed on the sparse result; they compare
    it bit for bit, its Inf too."""
    with recorder.record(tmp_path / "run.zarr", mode="full") as run:
        _sym_norm(EDGES, 4)
        run.next_iteration()
        _sym_norm(EDGES[:, EDGES[1] != 0], 4)  # node 0 has no incoming edge: the edge 0 -> 1 gets Inf
    rec = replayer.open(tmp_path / "run.zarr")
    origin = replayer.first_nonfinite(rec, ops=True)
    assert origin.step is not None and origin.step.index == 1
    assert "output (1 Inf of 6 stored values)" in origin.cause, origin.cause
    assert origin.op is not None and origin.op.name == "aten::rsqrt"
    assert [r.name for r in rec.step(1).records if r.nonfinite] == ["output", "output:values"]
    info = replayer.bundle(rec, 1, tmp_path / "b.pdbg", verify=True)
    assert info.verified and info.by_statistics == [] and info.verdict == "bitwise match"
    bundled = replayer.replay(replayer.open(tmp_path / "b.pdbg"))
    assert bundled.match and bundled.by_statistics == [] and bundled.outputs[0].recorded["inf"] == 1
    assert _same_sparse(replayer.open(tmp_path / "b.pdbg").main_step.tensor("output"), rec.step(1).tensor("output"))


@recorder.paper_step("Eq. 13", description="GCN propagation with a sparse adjacency given")
def _propagate(adj: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    return torch.sparse.mm(adj, h)


@recorder.paper_step("Eq. 16", description="H' = A H W, a GCN layer given its adjacency")
class _GCNLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, adj: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(adj @ self.lin(x))


def _adjacency(kind: str, g: torch.Generator, transpose: bool = False) -> torch.Tensor:
    """A weighted adjacency of 6 nodes and 12 edges (some repeated) of layout ``kind``: "coo" as made (not
    coalesced, its repeated edges twice), "coalesced", "csr", "csc"."""
    src, dst = torch.randint(0, 6, (12,), generator=g), torch.randint(0, 6, (12,), generator=g)
    adj = torch.sparse_coo_tensor(torch.stack([src, dst] if transpose else [dst, src]), torch.rand(12, generator=g),
                                  (6, 6))
    return {"coo": lambda: adj, "coalesced": adj.coalesce, "csr": adj.coalesce().to_sparse_csr,
            "csc": adj.coalesce().to_sparse_csc}[kind]()


def _train_gcn(path: Path | None, kind: str, mode: str = "full", transpose: bool = False, **options: Any,
               ) -> list[torch.Tensor]:
    """Four iterations of a GCN layer given a new adjacency of layout ``kind`` each; returns the adjacencies."""
    torch.manual_seed(0)
    layer = _GCNLayer()
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    given = []
    with recorder.record(path, model=layer, optimizer=opt, mode=mode, **options) if path else contextlib.nullcontext():
        for _ in range(4):
            given.append(_adjacency(kind, g, transpose))
            layer(given[-1], torch.randn(6, 3, generator=g)).square().sum().backward()
            opt.step()
            opt.zero_grad()
    return given


@_SPARSE_WARNINGS
@pytest.mark.parametrize("kind", ["coo", "coalesced", "csr", "csc"])
def test_a_gcn_layer_given_a_sparse_adjacency_replays_bit_for_bit(tmp_path: Path, kind: str) -> None:
    """A GCN layer given a sparse adjacency (torch.sparse_coo, coalesced or not, sparse_csr, ...) could not
    be replayed, verified, bisected or bundled at all: the recorder kept the adjacency's statistics only
    ("which the recorder keeps as statistics of its stored values only, in every mode"). The recording keeps
    its parts, and a replay gives the step the adjacency it was given, as it held it, bit for bit; every
    forward and backward step replays, alone, in `pdbg verify`, and from a bundle."""
    given = _train_gcn(tmp_path / "run.zarr", kind)
    rec = replayer.open(tmp_path / "run.zarr")
    forward = rec.steps.filter(phase="forward")
    step = forward[0]
    adj = next(r for r in step.records if r.name == "args.0")
    assert not adj.has_payload and step.holds_values(adj)
    for s, made in zip(forward, given):
        assert _same_sparse(s.tensor("args.0"), made)  # (an uncoalesced one: as made, its repeated edges twice)
    assert step.extra["sparse"]["args.0"].get("coalesced") == ({"coo": False, "coalesced": True}.get(kind))
    for s in rec.steps:
        result = replayer.replay(rec, s.index)
        assert result.match and not result.by_statistics, (s.index, [d.summary() for d in result.outputs])
        assert all(d.reason is None and d.measured for d in result.outputs)
    res = pdbg_here("replay", str(tmp_path / "run.zarr"), "Eq. 16@iter=2", cwd=tmp_path)
    assert res.returncode == 0 and "MATCH: bit for bit" in res.stdout, res.stdout + res.stderr
    res = pdbg_here("verify", str(tmp_path / "run.zarr"), "--json", cwd=tmp_path)
    doc = json.loads(res.stdout)
    assert (res.returncode, doc["mismatches"], doc["not_replayed"], "by_statistics" in doc, doc["matched"]) == \
        (0, [], [], False, 8), res.stdout + res.stderr
    info = replayer.bundle(rec, step.index, tmp_path / "b.pdbg", verify=True)
    assert info.verified and info.verdict == "bitwise match"
    bundled = replayer.open(tmp_path / "b.pdbg")
    assert _same_sparse(bundled.main_step.tensor("args.0"), given[0]) and replayer.replay(bundled).match
    edited = replayer.replay(rec, step.index, edit={"args.0": "x * 2"})  # other adjacency bytes: another result
    assert not edited.match and edited.outputs[0].mismatched > 0


@_SPARSE_WARNINGS
@pytest.mark.parametrize("kind", ["bsr", "bsc"])
def test_a_step_given_a_block_sparse_tensor_replays_bit_for_bit(tmp_path: Path, kind: str) -> None:
    """Block-sparse layouts (BSR, BSC: 2x2 blocks) keep their parts too, and replay bit for bit."""
    dense = torch.sparse_coo_tensor(EDGES, torch.arange(1.0, 9.0), (4, 4)).to_dense()
    given = dense.to_sparse_bsr((2, 2)) if kind == "bsr" else dense.to_sparse_bsc((2, 2))
    with recorder.record(tmp_path / "run.zarr", mode="full"):
        _densify(given, torch.ones(4, 2))
    rec = replayer.open(tmp_path / "run.zarr")
    assert _same_sparse(rec.step(0).tensor("args.0"), given)
    assert [r.name for r in rec.step(0).records if r.role == "component"] == [
        f"args.0:{p}" for p in (("crow_indices", "col_indices") if kind == "bsr" else ("ccol_indices", "row_indices"))
    ] + ["args.0:values"]
    result = replayer.replay(rec, 0)
    assert result.match and result.outputs[0].reason is None


@recorder.paper_step("Eq. 18", description="A H, A of any sparse layout")
def _densify(adj: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    return adj.to_dense() @ h


@_SPARSE_WARNINGS
def test_a_run_given_another_adjacency_differs_from_the_step_that_was_given_it(tmp_path: Path) -> None:
    """Two runs of a GCN layer, one given A and the other A^T (messages that flow the wrong way), whose
    stored values have the same statistics: `bisect --against` could only say the difference likely came
    in through the sparse argument, whose indices were not recorded. It compares the adjacencies' parts,
    bit for bit: they differ, from the first step on, and came from outside every recorded step."""
    _train_gcn(tmp_path / "a.zarr", "coalesced")
    _train_gcn(tmp_path / "t.zarr", "coalesced", transpose=True)
    div = replayer.first_divergence(replayer.open(tmp_path / "t.zarr"), replayer.open(tmp_path / "a.zarr"))
    assert div.step is None and div.first_difference is not None and div.first_difference.index == 0
    assert div.cause.startswith("the results first differ at step 0: Eq. 16 · _GCNLayer · forward · iteration 0 · "
                                "call 0, but its inputs differ too"), div.cause
    assert "statistics" not in div.cause


@recorder.paper_step("Eq. 17", description="row-normalise a weighted adjacency: A_ij / sum_j A_ij")
def _row_normalise(adj: torch.Tensor) -> torch.Tensor:
    degree = torch.sparse.sum(adj, dim=1).to_dense()
    src = adj.indices()[0]
    return torch.sparse_coo_tensor(adj.indices(), adj.values() / degree[src], adj.shape).coalesce()


@_SPARSE_WARNINGS
def test_a_nan_made_in_a_sparse_tensor_inside_a_step_given_one_is_found_and_replays(tmp_path: Path) -> None:
    """A step given a sparse adjacency that makes NaN in the sparse values it returns (a node whose edges
    all weigh 0: 0/0): its origin is that step, its NaN counted over the stored values, and the operation
    that made it is found by replaying it (`bisect --ops`), which could not run on a step given a sparse
    tensor; the replay and a bundle's match bit for bit, NaN included."""
    weights = torch.tensor([1.0, 0.0, 2.0, 3.0, 0.0, 1.0, 1.0, 1.0])  # node 1's two edges weigh 0 in iteration 1
    with recorder.record(tmp_path / "run.zarr", mode="full") as run:
        for it in range(2):
            adj = torch.sparse_coo_tensor(EDGES.flip(0), weights if it else weights + 1, (4, 4)).coalesce()
            _row_normalise(adj)
            run.next_iteration()
    rec = replayer.open(tmp_path / "run.zarr")
    assert [s.status for s in rec.steps] == ["ok", "nonfinite"]
    origin = replayer.first_nonfinite(rec, ops=True)
    assert origin.step is not None and origin.step.index == 1
    assert "output (2 NaN of 8 stored values)" in origin.cause, origin.cause
    assert origin.op is not None and origin.op.name == "aten::div", origin.op
    result = replayer.replay(rec, 1)
    assert result.match and result.outputs[0].recorded["nan"] == 2 and result.outputs[0].reason is None
    info = replayer.bundle(rec, 1, tmp_path / "b.pdbg", verify=True)
    assert info.verdict == "bitwise match"
    res = pdbg_here("bisect", str(tmp_path / "run.zarr"), "--ops", cwd=tmp_path)
    assert res.returncode == 1 and "aten::div" in res.stdout, res.stdout + res.stderr


@_SPARSE_WARNINGS
def test_a_flight_recording_keeps_the_sparse_adjacencies_of_its_ring(tmp_path: Path) -> None:
    """Flight mode keeps a sparse argument's parts with the other tensors of the iterations its ring wrote
    out, which replay bit for bit; the others kept its statistics, and a replay of one says why it cannot."""
    given = _train_gcn(tmp_path / "run.zarr", "csr", mode="flight", keep=2)
    rec = replayer.open(tmp_path / "run.zarr")
    forward = rec.steps.filter(phase="forward")
    kept = [s for s in forward if s.holds_values(next(r for r in s.records if r.name == "args.0"))]
    assert [s.iteration for s in kept] == [2, 3]
    for s in kept:
        assert _same_sparse(s.tensor("args.0"), given[s.iteration])
        assert replayer.replay(rec, s.index).match
    with pytest.raises(ReplayError, match=r"its input args\.0 is a sparse_csr tensor, of which the recording kept "
                                          r"statistics of its stored values only, not its indices and values \(flight "
                                          r"mode keeps the tensors of the iterations its ring wrote out \(2, 3\), and "
                                          r"iteration 0 is not one of them\)"):
        replayer.replay(rec, forward[0].index)
    res = pdbg_here("verify", str(tmp_path / "run.zarr"), "--json", cwd=tmp_path)
    doc = json.loads(res.stdout)
    assert (res.returncode, doc["mismatches"], doc["not_replayed"], doc["matched"]) == (0, [], [], 4), res.stdout


@_SPARSE_WARNINGS
def test_a_step_given_a_sparse_tensor_whose_parts_were_not_kept_is_refused_with_what_to_do(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A recording before schema 1.19 kept a sparse argument's statistics only: bundle and replay refuse
    its step, saying so and what to do, and `pdbg verify` lists such steps on one line. (Before, `pdbg
    bundle` said to "bundle a step recorded with payloads (mode full, or a flight dump)", which it was.)"""
    from tests.sealing import as_schema

    with monkeypatch.context() as patched:
        _without_parts(patched)
        with recorder.record(tmp_path / "run.zarr", mode="full") as run:
            for _ in range(4):
                _propagate(torch.sparse_coo_tensor(EDGES, torch.ones(8), (4, 4)), torch.ones(4, 2))
                run.next_iteration()
    as_schema(tmp_path / "run.zarr", "1.18")
    rec = replayer.open(tmp_path / "run.zarr")
    what = (r"its input args\.0 is a sparse_coo tensor, which recordings before schema 1\.19 keep as statistics of its "
            r"stored values only \(no payload; its indices are not recorded\); record again with this version \(mode "
            r"full, or flight\), or build the sparse tensor inside the step from dense indices and values \(an "
            r"edge_index\), to ")
    with pytest.raises(BundleError, match=r"^step 0 cannot be bundled: " + what + "bundle and replay it$"):
        replayer.bundle(rec, 0, tmp_path / "b.pdbg")
    with pytest.raises(ReplayError, match=r"^step 0 \(_propagate\) cannot be replayed: " + what + "replay it$"):
        replayer.replay(rec, 0)
    res = pdbg_here("verify", str(tmp_path / "run.zarr"), cwd=tmp_path)
    assert res.returncode == 2 and "  4 steps (step 0: Eq. 13 (_propagate), forward, iteration 0, call 0 ... step 3" \
        in res.stdout, res.stdout


@recorder.paper_step("Eq. 14", description="A_w = sparse(edge_index, sigmoid(w_e))")
class _EdgeWeights(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(-1, 1, 8))

    def forward(self, edge_index: torch.Tensor, n: int) -> torch.Tensor:
        return torch.sparse_coo_tensor(edge_index, torch.sigmoid(self.w), (n, n))


@_SPARSE_WARNINGS
def test_a_backward_from_a_sparse_result_is_refused_saying_so(tmp_path: Path) -> None:
    """The backward of a step returning a sparse tensor of learned edge weights was refused for "its
    forward's output holds no tensor the recorder follows for gradients": it says that output is
    sparse, which the recorder does not follow, and what can be replayed."""
    weights = _EdgeWeights()
    with recorder.record(tmp_path / "run.zarr", model=weights, mode="full"):
        torch.sparse.mm(weights(EDGES, 4), torch.ones(4, 2)).sum().backward()
    rec = replayer.open(tmp_path / "run.zarr")
    backward = rec.steps.filter(phase="backward")[0]
    with pytest.raises(ReplayError, match=rf"^backward step {backward.index} has no grad outputs to start a backward "
                                          r"from: its forward's output is a sparse_coo tensor of 8 stored values, "
                                          r"whose gradient the recorder does not follow \(it follows strided tensors "
                                          r"only\); replay the forward, step 0, or return the dense values \(edge "
                                          r"weights\) from the step and build the sparse tensor after it$"):
        replayer.replay(rec, backward.index)
    assert replayer.replay(rec, 0).match


@_SPARSE_WARNINGS
def test_parts_that_do_not_make_the_sparse_tensor_are_called_damage(tmp_path: Path) -> None:
    """A recording whose parts do not make a valid sparse tensor (an edit: an uncoalesced COO tensor's
    flag set to coalesced, whose repeated indices torch's kernels would then trust) is called damaged,
    not given to a step; parts it does not name leave the record's statistics, as before 1.19."""
    from recorder.errors import FormatError
    from tests.sealing import rewrite_docs

    _train_gcn(tmp_path / "run.zarr", "coo")
    rewrite_docs(tmp_path / "run.zarr", lambda i, doc: json.loads(json.dumps(doc).replace(
        '"coalesced": false', '"coalesced": true')) if '"coalesced": false' in json.dumps(doc) else None)
    rec = replayer.open(tmp_path / "run.zarr")
    with pytest.raises(FormatError, match=r"the parts of sparse tensor 'args\.0' of step 0 \(args\.0:indices, "
                                          r"args\.0:values\) do not make a sparse_coo tensor of shape \[6, 6\] "
                                          r"\(.*coalesced.*\); the recording is damaged"):
        replayer.replay(rec, 0)
    rewrite_docs(tmp_path / "run.zarr", lambda i, doc: json.loads(json.dumps(doc).replace(
        '"indices": "args.0:indices"', '"indices": "args.0:nothing"')) if '"args.0:indices"' in json.dumps(doc)
        else None)
    rec = replayer.open(tmp_path / "run.zarr")
    step = rec.step(0)
    adj = next(r for r in step.records if r.name == "args.0")
    assert step.sparse_parts(adj) is None
    with pytest.raises(ReplayError, match=r"not its indices and values \(its part args\.0:nothing is not among the "
                                          r"step's records \(the recording is damaged\)\)"):
        replayer.replay(rec, 0)


@recorder.paper_step("Eq. 19", description="H' = A H W, the adjacency a buffer of the layer")
class _GCNWithGraph(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("adj", torch.sparse_coo_tensor(EDGES, torch.linspace(0.1, 0.8, 8), (4, 4)).coalesce())
        self.lin = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sparse.mm(self.adj, self.lin(x))


@_SPARSE_WARNINGS
def test_a_module_holding_a_sparse_adjacency_as_a_buffer_replays_bit_for_bit(tmp_path: Path) -> None:
    """A GCN layer that holds its graph's sparse adjacency as a buffer was refused ("keep its indices and
    values as dense buffers and build it in forward"): the buffer keeps its parts, and the layer's
    forward and backward steps replay bit for bit."""
    torch.manual_seed(0)
    layer = _GCNWithGraph()
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    with recorder.record(tmp_path / "run.zarr", model=layer, optimizer=opt, mode="full"):
        for _ in range(2):
            layer(torch.randn(4, 3)).sum().backward()
            opt.step()
            opt.zero_grad()
    rec = replayer.open(tmp_path / "run.zarr")
    assert _same_sparse(rec.step(0).tensor("adj", "buffer"), layer.adj)
    for step in rec.steps:
        result = replayer.replay(rec, step.index)
        assert result.match and all(d.reason is None for d in result.outputs), [d.summary() for d in result.outputs]
