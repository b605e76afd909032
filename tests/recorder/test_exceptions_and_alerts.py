"""Step status: an exception is recorded and re-raised unchanged; non-finite outputs and broken
watch expectations mark the step."""

from __future__ import annotations

import sys

import pytest
import torch

import recorder
from recorder.store.reader import RunReader


class PaperBug(ValueError):
    pass


@recorder.paper_step("Eq. 4", description="normalise")
def normalise(x: torch.Tensor, fail: bool = False) -> torch.Tensor:
    if fail:
        raise PaperBug("denominator is zero in Eq. 4")
    return x / x.sum()


def refuse(grad: torch.Tensor) -> None:
    raise RuntimeError("gradient check failed")


@recorder.paper_step("Eq. 4", description="normalise, the gradient of its denominator checked")
def checked_normalise(x: torch.Tensor, check: bool = False) -> torch.Tensor:
    total = x.sum()
    if check:  # raises in the middle of this step's backward: its input's gradient never comes
        total.register_hook(refuse)
    return x / total


@recorder.paper_step("Eq. 5")
def outer(x: torch.Tensor) -> torch.Tensor:
    return normalise(x, fail=True)


@recorder.paper_step("Eq. 7")
def attention(x: torch.Tensor, width: int = 4) -> torch.Tensor:
    w = torch.softmax(x, dim=-1) * 2 + 1  # breaks the (0, 1) expectation
    recorder.watch(w, "weights", expected_shape=(None, width), expected_range=(0.0, 1.0),
                   expected_mean=(0.25, 0.01), reference="Eq. 7")
    return w


def _status(rank, i):
    return ("ok", "alert", "nonfinite", "exception")[int(rank.column("steps/status")[i])]


def test_exception_recorded_and_reraised_unchanged(run_path):
    """The exception object reaches the caller untouched; the step and the run say what happened."""
    x = torch.ones(3)
    with pytest.raises(PaperBug) as caught:
        with recorder.record(run_path) as run:
            normalise(x)
            try:
                outer(x)
            except PaperBug as exc:
                first = exc
                raise
    assert caught.value is first and str(caught.value) == "denominator is zero in Eq. 4"
    assert run.status == "crashed"
    reader = RunReader(run_path)
    assert reader.status == "crashed"
    rank = reader.rank(0)
    assert [_status(rank, i) for i in range(len(rank))] == ["ok", "exception", "exception"]
    inner = rank.doc(int(rank.column("steps/extra")[2]))["exception"]
    assert inner["type"] == "tests.recorder.test_exceptions_and_alerts:PaperBug"
    assert inner["message"] == "denominator is zero in Eq. 4"
    assert "raise PaperBug" in inner["traceback"]
    assert int(rank.column("steps/parent")[2]) == 1
    assert reader.attrs["final"]["exception"]["message"] == "denominator is zero in Eq. 4"


def test_nonfinite_output_marks_step(run_path):
    """A step whose output holds NaN/Inf is 'nonfinite' and its statistics count them."""
    with recorder.record(run_path):
        normalise(torch.tensor([1.0, -1.0, 0.0]))  # 0/0 and x/0
    rank = RunReader(run_path).rank(0)
    assert _status(rank, 0) == "nonfinite"
    out = next(r for r in rank.tensor_records(0) if r.role == "output")
    assert (out.stats["nan"], out.stats["inf"]) == (1, 2)


def test_broken_watch_expectations_are_alerts(run_path):
    """Range, mean and shape expectations that do not hold are listed as alerts on the step."""
    with recorder.record(run_path):
        attention(torch.randn(2, 4))  # holds the shape, breaks range and mean
        attention(torch.randn(2, 5))  # breaks the shape too
    rank = RunReader(run_path).rank(0)
    assert _status(rank, 0) == _status(rank, 1) == "alert"
    alerts0 = rank.doc(int(rank.column("steps/extra")[0]))["alerts"]
    assert {a["check"] for a in alerts0} == {"range", "mean"}
    assert all(a["watch"] == "weights" and a["reference"] == "Eq. 7" for a in alerts0)
    alerts1 = rank.doc(int(rank.column("steps/extra")[1]))["alerts"]
    assert {a["check"] for a in alerts1} == {"range", "mean", "shape"}
    watched = [r for r in rank.tensor_records(0) if r.role == "watch"]
    assert [w.name for w in watched] == ["weights"] and watched[0].has_payload


def test_kept_expectations_are_ok(run_path):
    """A watch whose expectations hold leaves the step 'ok'."""
    @recorder.paper_step("Eq. 8")
    def probs(x):
        return recorder.watch(torch.softmax(x, -1), "p", expected_range=(0, 1), expected_shape=(None, 4))

    with recorder.record(run_path):
        probs(torch.randn(3, 4))
    rank = RunReader(run_path).rank(0)
    assert _status(rank, 0) == "ok"
    assert rank.doc(int(rank.column("steps/extra")[0]))["watches"][0]["name"] == "p"


def test_watch_outside_recording_is_a_no_op():
    """watch() returns its tensor unchanged when nothing is recording."""
    t = torch.randn(3)
    assert recorder.watch(t, "x", expected_range=(0, 1)) is t


def test_backward_pass_that_raises_does_not_stall_the_recording(run_path):
    """A backward pass aborted by an exception still writes its steps; later steps are committed."""
    with recorder.record(run_path) as run:
        for i in range(3):
            x = torch.randn(4, requires_grad=True)
            try:
                checked_normalise(x * 1.0, check=i == 0).sum().backward()
            except RuntimeError as exc:
                assert "gradient check failed" in str(exc)
            run.next_iteration()
    rank = RunReader(run_path).rank(0)
    phases = [int(p) for p in rank.column("steps/phase")]
    assert phases == [0, 1, 0, 1, 0, 1]
    notes = rank.doc(int(rank.column("steps/extra")[1]))["notes"]
    assert notes == ["the backward pass stopped before this step finished"]
    assert int(rank.column("steps/extra")[3]) == -1


def test_backward_pass_that_raises_just_before_close_is_still_written(run_path):
    """A backward step left open by a failed backward pass at the very end is written on close."""
    with recorder.record(run_path) as run:
        x = torch.randn(4, requires_grad=True)
        try:
            checked_normalise(x * 1.0, check=True).sum().backward()
        except RuntimeError:
            pass
    assert run.status == "complete"
    rank = RunReader(run_path).rank(0)
    assert [int(p) for p in rank.column("steps/phase")] == [0, 1]
    assert rank.doc(int(rank.column("steps/extra")[1]))["notes"] == [
        "the backward pass stopped before this step finished"]


def test_only_the_steps_a_stopped_backward_pass_cut_short_are_noted(run_path):
    """A backward pass stopped partway (an exception, or SIGTERM in flight mode): the steps it had
    finished before, whose gradients all came and which replay bit for bit, were noted "the backward
    pass stopped before this step finished" as well. Only the step it stopped in is noted now, and
    it has the exception."""
    import replayer

    with recorder.record(run_path, mode="full"):
        x = torch.randn(4, requires_grad=True)
        h = checked_normalise(x * 1.0, check=True)  # its backward comes last, and stops
        with pytest.raises(RuntimeError, match="gradient check failed"):
            normalise(h * 2.0).pow(2).sum().backward()
    rec = replayer.open(run_path)
    backward = {s.name: s for s in rec.steps if s.phase == "backward"}
    assert set(backward) == {"normalise", "checked_normalise"}
    assert "notes" not in backward["normalise"].extra and backward["normalise"].status == "ok"
    assert replayer.replay(rec, backward["normalise"].index).match
    assert backward["checked_normalise"].extra["notes"] == ["the backward pass stopped before this step finished"]
    assert backward["checked_normalise"].status == "exception"


class Plain(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


@recorder.paper_step("Eq. 1", description="a block")
class Block(Plain):
    pass


@pytest.mark.parametrize("how", ["paper_step", "modules="])
def test_a_caught_exception_leaves_no_backward_step_behind(tmp_path, how):
    """A module step that raises, the exception caught by the training loop (a bad batch skipped),
    and the module then trained as usual: its parameters' gradients are the next call's, and the
    failed call has no backward step (it had one, made of the next call's gradients, which no
    replay could match)."""
    import replayer

    torch.manual_seed(0)
    model = Block() if how == "paper_step" else torch.nn.Sequential(Plain())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "run.zarr"
    with recorder.record(path, model=model, optimizer=opt, mode="full",
                         **({} if how == "paper_step" else {"modules": ["0"]})):
        for it in range(2):
            with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
                model(torch.randn(8, 5))  # the bad batch
            model(torch.randn(8, 4)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
    rec = replayer.open(path)
    assert [(s.phase, s.iteration, s.call, s.status) for s in rec.steps] == [
        ("forward", 0, 0, "exception"), ("forward", 0, 1, "ok"), ("backward", 0, 1, "ok"),
        ("forward", 1, 0, "exception"), ("forward", 1, 1, "ok"), ("backward", 1, 1, "ok")]
    for step in rec.steps:
        assert replayer.replay(rec, step.index).match


@pytest.mark.parametrize("mode", ["full", "stats", "flight"])
@pytest.mark.parametrize("code", [0, None, 3])
def test_sys_exit_in_a_with_block_closes_the_run_as_its_exit_status_says(tmp_path, mode, code):
    """sys.exit(0) (or sys.exit()) in a `with recorder.record(...)` block, as a job does after its
    checkpoint for a requeue, closed the run "crashed", "ended by: SystemExit: 0", where `pdbg record`
    closed the same exit "complete". Exit status 0 is complete now; another is crashed, as before."""
    import replayer

    path = tmp_path / "run.zarr"
    with pytest.raises(SystemExit), recorder.record(path, mode=mode) as run:
        normalise(torch.randn(4))
        sys.exit(code)
    rec = replayer.open(path)
    assert run.status == rec.status == ("crashed" if code else "complete")
    assert rec.ended_by == ("SystemExit: 3" if code else None)
    assert len(rec.steps) == 1


_STOP_SCRIPTS = {
    "modules": """
import torch
class Inner(torch.nn.Module):
    def forward(self, x):
        return torch.log(x)
class Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.inner = torch.nn.Linear(4, 4), Inner()
    def forward(self, x):
        return self.inner(self.fc(x)).sum()
torch.manual_seed(0)
m = Outer()
for it in range(3):
    m(torch.randn(2, 4)).backward()
""",
    "paper": """
import torch, recorder
@recorder.paper_step("Eq. 2")
def inner(x):
    return torch.log(x)
@recorder.paper_step("Alg. 1")
class Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
    def forward(self, x):
        return inner(self.fc(x)).sum()
torch.manual_seed(0)
m = Outer()
for it in range(3):
    m(torch.randn(2, 4)).backward()
""",
}


@pytest.mark.parametrize("how", ["modules", "paper"])
def test_pdbg_record_names_the_step_whose_nan_stopped_the_run(tmp_path, how):
    """With --on-anomaly stop, the NonFiniteError raised as an inner step returns NaN unwinds through the
    outer step: pdbg record's summary said it "escaped step 0 (Outer)" and opened the outer step. It names
    the inner step, marked nonfinite, whose NaN stopped the run, and opens it there."""
    from tests.cli import pdbg

    (tmp_path / "train.py").write_text(_STOP_SCRIPTS[how])
    extra = ["--modules", "**"] if how == "modules" else []
    res = pdbg("record", "-o", "run.zarr", "--on-anomaly", "stop", *extra, "--", "train.py", cwd=tmp_path)
    assert res.returncode != 0 and "NonFiniteError" in res.stderr, res.stderr
    rank = RunReader(tmp_path / "run.zarr").rank(0)
    statuses = [_status(rank, i) for i in range(len(rank))]
    stopper = statuses.index("nonfinite")
    assert statuses[0] == "exception" and stopper > 0, statuses
    summary = res.stderr.strip().splitlines()[-1]
    assert f"NonFiniteError stopped the run at step {stopper} (" in summary, summary
    assert summary.endswith(f"run.zarr --at {stopper}"), summary


def test_pdbg_record_names_the_step_whose_breakpoint_stopped_the_run(tmp_path):
    """A breakpoint with action="stop" at an inner module: its BreakpointStop, raised as that step returns,
    unwinds through the outer step, and pdbg record's summary said it "escaped step 6 (Outer)". It names the
    inner step the breakpoint stopped at, and opens it there."""
    from tests.cli import pdbg

    (tmp_path / "train.py").write_text("""
import torch, recorder
class Inner(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
    def forward(self, x):
        return self.fc(x)
class Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()
    def forward(self, x):
        return self.inner(x) * 2
torch.manual_seed(0)
m = Outer()
recorder.breakpoint("inner", lambda s: s.iteration == 1, "stop")
opt = torch.optim.SGD(m.parameters(), lr=0.1)
for it in range(3):
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
""")
    res = pdbg("record", "-o", "run.zarr", "--modules", "**", "--", "train.py", cwd=tmp_path)
    assert res.returncode != 0 and "BreakpointStop" in res.stderr, res.stderr
    rank = RunReader(tmp_path / "run.zarr").rank(0)
    statuses = [_status(rank, i) for i in range(len(rank))]
    outer = max(i for i, status in enumerate(statuses) if status == "exception")
    summary = res.stderr.strip().splitlines()[-1]
    assert f"BreakpointStop stopped the run at step {outer + 1} (Inner at inner, iteration 1)" in summary, summary
    assert summary.endswith(f"run.zarr --at {outer + 1}"), summary
