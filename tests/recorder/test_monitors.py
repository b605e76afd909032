"""Monitors while recording: on_anomaly actions, user checks, semantic breakpoints."""

from __future__ import annotations

import html
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

import recorder
from recorder.errors import RecordingError
from recorder.store import layout
from recorder.store.reader import RunReader
from tests.cli import pdbg_here

ROOT = Path(__file__).resolve().parents[2]


@recorder.paper_step("Eq. 2", description="SmoothReLU(x) = log(1 + exp(x + beta)) / gamma")
def smooth_relu(x: torch.Tensor, beta: float = 1.0, gamma: float = 1.0) -> torch.Tensor:
    return torch.log1p(torch.exp(x + beta)) / gamma


@recorder.paper_step("Eq. 5", description="root of the energy")
def root(x: torch.Tensor) -> torch.Tensor:
    return x.sqrt()


@recorder.paper_step("Eq. 8", description="a learned step size, finite forward; 0 makes its gradient NaN")
class StepSize(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sqrt(self.s * self.s)  # d/ds at 0: inf * 0


@recorder.paper_step("Eq. 9", description="a layer whose input is scaled by a learned step size")
class QuantLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.q = StepSize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.q(x))


def statuses(path: Path) -> list[tuple[str, str, int]]:
    rank = RunReader(str(path)).rank(0)
    col = rank.column
    return [(rank.doc(int(col("steps/name")[i])), layout.STATUSES[int(col("steps/status")[i])],
             int(col("steps/iteration")[i])) for i in range(len(rank))]


def alerts(path: Path) -> list[tuple[int, list[str]]]:
    """(iteration, alert messages) of every step that has alerts."""
    rank = RunReader(str(path)).rank(0)
    out = []
    for i in range(len(rank)):
        extra = int(rank.column("steps/extra")[i])
        if extra >= 0 and rank.doc(extra).get("alerts"):
            out.append((int(rank.column("steps/iteration")[i]), [a["message"] for a in rank.doc(extra)["alerts"]]))
    return out


@pytest.fixture(autouse=True)
def _no_leftover_monitors() -> Iterator[None]:
    yield
    from recorder import monitors

    monitors._CHECKS.clear()
    monitors._BREAKPOINTS.clear()


class TestOnAnomaly:
    def test_stop_raises_at_the_first_nonfinite_forward_step(self, run_path: Path) -> None:
        """on_anomaly='stop' raises NonFiniteError naming the step in paper terms; what came before is on disk."""
        with pytest.raises(recorder.NonFiniteError) as info, recorder.record(run_path, on_anomaly="stop") as run:
            for i in range(5):
                smooth_relu(torch.full((3,), 10.0 * i) * torch.tensor([1.0, 2.0, 3.0]))  # exp(91) overflows
                smooth_relu(torch.zeros(2))
                run.next_iteration()
        assert str(info.value) == "Eq. 2 (smooth_relu) forward, iteration 3, call 0: output has 1 Inf"
        got = statuses(run_path)
        assert got[-1] == ("smooth_relu", "nonfinite", 3) and len(got) == 7
        assert [s for s in got[:-1] if s[1] != "ok"] == []
        assert RunReader(str(run_path)).status == "crashed"

    def test_stop_raises_out_of_backward_at_a_nonfinite_gradient(self, run_path: Path) -> None:
        """A finite forward whose backward gives Inf stops in loss.backward(), naming the backward step and
        the gradient that holds it (of args.0, not args.0 itself)."""
        with pytest.raises(recorder.NonFiniteError, match=r"^Eq. 5 \(root\) backward, iteration 1, call 0: "
                                                          r"the gradient of args.0 has 1 Inf$"), \
                recorder.record(run_path, on_anomaly="stop") as run:
            for values in ([1.0, 4.0], [0.0, 4.0], [0.0, 9.0]):
                x = torch.tensor(values, requires_grad=True)
                root(x).sum().backward()
                run.next_iteration()
        got = statuses(run_path)
        assert got == [("root", "ok", 0), ("root", "ok", 0), ("root", "ok", 1), ("root", "nonfinite", 1)]

    def test_a_stop_names_the_gradient_and_the_nan_or_inf_that_came_in(self, tmp_path: Path) -> None:
        """A NaN loss sends NaN into the last layer's backward: the stop said "bias has 4 NaN" (the bias
        is finite: its gradient is not) and not that the NaN came in through the grad output. An Inf the
        optimizer wrote into a weight that the layer turns into NaN: the stop did not say the weight
        already held it."""
        def train(path: Path, loss_factor: float, inf_weight: bool) -> None:
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
            if inf_weight:
                with torch.no_grad():
                    model[0].weight[0] = float("inf")
            with recorder.record(path, model=model, modules=["0", "1"], on_anomaly="stop"):
                (model(torch.randn(3, 4)).sum() * loss_factor).backward()

        with pytest.raises(recorder.NonFiniteError, match=r"^Linear at 1 backward, iteration 0, call \d+: the gradient "
                                                          r"of (weight|bias|args\.0) has \d+ NaN; it came in: its grad "
                                                          r"output already held 6 NaN when the backward step began$"):
            train(tmp_path / "loss.zarr", float("nan"), inf_weight=False)
        with pytest.raises(recorder.NonFiniteError, match=r"^Linear at 0 forward, iteration 0, call \d+: output has "
                                                          r"\d+ NaN( and \d+ Inf)?; its parameter weight already held "
                                                          r"4 Inf when the call began$"):
            train(tmp_path / "weight.zarr", 1.0, inf_weight=True)

    def test_a_stop_in_a_nested_steps_backward_names_the_inner_step_as_bisect_does(self, run_path: Path) -> None:
        """A NaN made in the backward of a step nested in another (a quantizer's step size inside a quantized
        layer) is in both steps' gradients: the stop named the outer step, bisect the inner one that made it.
        The stop names the inner one, as it does for a NaN made in the forward."""
        import replayer

        model = QuantLayer()
        with pytest.raises(recorder.NonFiniteError) as info, recorder.record(run_path, model=model,
                                                                             on_anomaly="stop"):
            model(torch.randn(3, 4)).sum().backward()
        origin = replayer.first_nonfinite(replayer.open(run_path)).step
        assert (origin.name, origin.phase, origin.module_path) == ("StepSize", "backward", "q")
        assert str(info.value).startswith("Eq. 8 (StepSize) at q backward, iteration 0, call 0: the gradient of s "
                                          "has 1 NaN"), str(info.value)

    def test_a_mask_made_at_every_call_is_no_anomaly_and_an_overflow_still_is(self, run_path: Path) -> None:
        """An additive -inf attention mask, made and passed on at every call, is what the model
        means (first_nonfinite passes it over too): on_anomaly='stop' let it stop training at
        iteration 0, and flight mode wrote its ring at every iteration. A step whose Inf filled its result
        at its first call only is stopped at its next call, which names that first one; a NaN, at once (and
        so is a single value that is Inf: test_a_loss_that_is_inf_at_every_call_stops_at_its_first)."""
        with recorder.record(run_path, on_anomaly="stop", mode="flight") as run:
            for _ in range(4):
                masked(torch.randn(2, 4, 4))
                run.next_iteration()
        flight = RunReader(str(run_path)).attrs["final"]["flight"]
        assert RunReader(str(run_path)).status == "complete" and [d["reason"] for d in flight["dumps"]] == ["end"]
        assert [s[:2] for s in statuses(run_path)] == [("masked", "ok"), ("causal_mask", "nonfinite")] * 4

        path = run_path.with_name("first_only.zarr")
        with pytest.raises(recorder.NonFiniteError) as info, recorder.record(path, on_anomaly="stop") as run:
            for i in range(3):
                smooth_relu(torch.tensor([100.0 if i == 0 else 0.0] * 2))  # exp(101) overflows at the first call
                run.next_iteration()
        assert str(info.value) == ("Eq. 2 (smooth_relu) forward, iteration 0, call 0: output has 2 Inf (its next "
                                   "call, step 1, made none: not a mask)")
        told: list[tuple[int, str]] = []
        with recorder.record(run_path.with_name("told.zarr")) as run:
            run.notify_nonfinite(lambda index, message: told.append((index, message)))
            for i in range(3):
                masked(torch.randn(2, 4, 4))
                smooth_relu(torch.tensor([100.0 if i == 0 else 0.0] * 2))
                run.next_iteration()
        assert [index for index, _ in told] == [2]  # the overflow's step, told at its next call (step 5)
        with pytest.raises(recorder.NonFiniteError, match=r"iteration 0, call 0: output has 1 NaN$"), \
                recorder.record(run_path.with_name("nan.zarr"), on_anomaly="stop"):
            root(torch.tensor([-1.0]))

        # A run that never marks its iterations (an evaluation loop) numbers every call anew: the
        # mask is still meant, live and in first_nonfinite alike (which named it the origin).
        import replayer

        quiet = run_path.with_name("no_iterations.zarr")
        with recorder.record(quiet, on_anomaly="stop"):
            for _ in range(4):
                masked(torch.randn(2, 4, 4))
        origin = replayer.first_nonfinite(replayer.open(quiet))
        assert origin.step is None and origin.cause.startswith("no NaN recorded; Inf appears only in steps that "
                                                               "hold it at every call"), origin.cause

    def test_a_loss_that_is_inf_at_every_call_stops_at_its_first(self, run_path: Path) -> None:
        """A CTC loss of +inf at call #0 of every iteration (a loop that skips the batches whose loss is not
        finite, so that a skipped batch and the next share an iteration): Inf filling the result at every call
        so far was taken for a mask's, and on_anomaly='stop' never stopped. A single value that is Inf is no
        mask's: the stop comes at the first, and names it, as first_nonfinite does."""
        from tests.replayer import nanmodels

        with pytest.raises(recorder.NonFiniteError) as info:
            nanmodels.record_skipping_ctc(run_path, (0, 2), on_anomaly="stop")
        assert str(info.value) == "Eq. 5 (ctc_loss) forward, iteration 0, call 0: output has 1 Inf"

    def test_a_padding_mask_some_batches_do_not_need_does_not_stop_training(self, run_path: Path) -> None:
        """A padding mask made at iteration 0, none at iteration 1 (a batch without padding): the stop
        called iteration 0's Inf "not a mask" and ended training there. Inf on part of the mask, as at an
        earlier call, is a mask's whatever the calls in between held; the softmax that makes NaN over a
        row all masked at iteration 4 stops it. Inf that filled the result of a first call alone is still
        stopped at the next call (test_a_mask_made_at_every_call_is_no_anomaly_and_an_overflow_still_is)."""
        with pytest.raises(recorder.NonFiniteError) as info, recorder.record(run_path, on_anomaly="stop") as run:
            for i in range(6):
                pad = torch.zeros(2, 4, dtype=torch.bool)
                if i not in (1, 3):
                    pad[0, 2:] = True
                if i == 4:
                    pad[1] = True
                padded_attention(torch.randn(2, 3, 4), padding_mask(pad))
                run.next_iteration()
        assert str(info.value) == ("Eq. 8 (padded_attention) forward, iteration 4, call 0: output has 12 NaN; its "
                                   "input args.1 already held 6 Inf when the call began")
        assert [s[:2] for s in statuses(run_path) if s[1] != "ok"] == \
            [("padding_mask", "nonfinite")] * 3 + [("padded_attention", "nonfinite")]

    def test_an_experts_two_calls_in_one_layer_call_are_no_habit(self, run_path: Path) -> None:
        """A top-2 layer calls experts.1 twice per iteration (calls #1 and #3 of ExpExpert). In iteration 0
        both overflow, filling their results; in iteration 1 call #3 makes none. Call #3 of iteration 0
        found no earlier call with its number, and the expert's call #1 just before it, in the same layer
        call, stood for it: Inf "made at every call so far", a mask's, so training never stopped, where
        bisect names that call. A sibling's Inf is no habit: its next call with that number judges it, as
        a first call's."""
        import replayer

        layer = TwoChoices()
        with pytest.raises(recorder.NonFiniteError) as info, recorder.record(run_path, on_anomaly="stop") as run:
            for i in range(3):
                layer(torch.full((2,), 1000.0), torch.full((2,), 1000.0 if i == 0 else 0.0))
                run.next_iteration()
        assert str(info.value) == ("Eq. 3 (ExpExpert) at experts.1 forward, iteration 0, call 3: output has 2 Inf (its "
                                   "next call, step 9, made none: not a mask)"), str(info.value)
        origin = replayer.first_nonfinite(replayer.open(run_path)).step
        assert origin is not None and (origin.module_path, origin.iteration, origin.call) == ("experts.1", 0, 3)

    def test_a_recording_closed_later_says_the_stop_ended_it(self, run_path: Path) -> None:
        """A stop raised out of a framework's loop that has no exception hook (Hugging Face's
        Trainer): the recording is closed later, at exit, without the exception. It still says
        what ended it (it said nothing: pdbg info had no "ended by")."""
        import replayer

        run = recorder.record(run_path, on_anomaly="stop")
        with pytest.raises(recorder.NonFiniteError):
            for i in range(3):
                smooth_relu(torch.tensor([100.0 * i]))
                run.next_iteration()
        run.close("crashed")
        assert replayer.open(run_path).ended_by == ("NonFiniteError: Eq. 2 (smooth_relu) forward, iteration 1, "
                                                    "call 0: output has 1 Inf")

    def test_record_only_marks(self, run_path: Path) -> None:
        """The default marks the step nonfinite and lets training go on."""
        with recorder.record(run_path) as run:
            for i in range(3):
                smooth_relu(torch.tensor([100.0 * i]))
                run.next_iteration()
        assert [s[1] for s in statuses(run_path)] == ["ok", "nonfinite", "nonfinite"]

    def test_a_model_that_is_not_a_module_is_refused(self, run_path: Path) -> None:
        """torch.compile of a compiled module returns a function: given as the model, recording
        stopped at the first call ("'function' object has no attribute 'modules'"). Refused in one
        line, before anything is created."""
        with pytest.raises(RecordingError, match=r"^model must be the torch.nn.Module being trained, not a "
                                                 r"function \(torch.compile of a compiled module returns a function"):
            recorder.record(run_path, model=lambda x: x)
        assert not run_path.exists()

    def test_unknown_action_is_refused(self, run_path: Path) -> None:
        """A misspelt action is a one-line error before anything is created."""
        with pytest.raises(RecordingError, match="unknown on_anomaly 'halt'"):
            recorder.record(run_path, on_anomaly="halt")
        assert not run_path.exists()


@recorder.paper_step("Eq. 3", description="an additive causal mask: -inf above the diagonal")
def causal_mask(n: int) -> torch.Tensor:
    return torch.full((n, n), float("-inf")).triu(1)


@recorder.paper_step("Eq. 4", description="masked attention weights")
def masked(scores: torch.Tensor) -> torch.Tensor:
    return (scores + causal_mask(scores.shape[-1])).softmax(-1)


@recorder.paper_step("Eq. 7", description="an additive -inf key padding mask")
def padding_mask(pad: torch.Tensor) -> torch.Tensor:
    return torch.zeros(pad.shape).masked_fill(pad, float("-inf"))


@recorder.paper_step("Eq. 8", description="attention weights over the keys, padding masked")
def padded_attention(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (scores + mask[:, None, :]).softmax(-1)


@recorder.paper_step("Eq. 3", description="an expert: exp of its tokens")
class ExpExpert(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.exp()


@recorder.paper_step("Algorithm 1", description="a top-2 layer: each expert called once per choice")
class TwoChoices(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList([ExpExpert(), ExpExpert()])

    def forward(self, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        """``first``, ``second``: the tokens each choice sends to experts.1 (experts.0 gets zeros)."""
        out = self.experts[0](torch.zeros(2)) + self.experts[1](first)
        return out + self.experts[0](torch.zeros(2)) + self.experts[1](second)


@recorder.paper_step("Eq. 6", description="a block around SmoothReLU")
def outer(x: torch.Tensor) -> torch.Tensor:
    return smooth_relu(x * 1.0) + 1.0


def test_the_step_a_stop_left_replays_and_the_op_is_found(run_path: Path) -> None:
    """on_anomaly='stop' stops training inside an enclosing step, which records the recorder's own
    NonFiniteError: its replay runs through and matches (no output was recorded to compare, and
    it says so); the origin is the inner step, down to its operation."""
    import replayer

    with pytest.raises(recorder.NonFiniteError), recorder.record(run_path, on_anomaly="stop") as run:
        for i in range(5):
            outer(torch.full((3,), 30.0 * i))  # exp(91) overflows at i == 3
            run.next_iteration()
    rec = replayer.open(run_path)
    stopped = rec.steps.filter(name="outer", iteration=3)[0]
    result = replayer.replay(rec, stopped.index)
    assert result.match and any("stopped training inside this step" in w for w in result.warnings)
    # The step inside it, which went non-finite, is compared as in any replay of the enclosing step (it was
    # not: the replay said MATCH of nothing compared); without the steps inside, nothing is compared, and said.
    assert [(s.step.name, s.match) for s in result.inner] == [("smooth_relu", True)] and result.compared
    alone = replayer.replay(rec, stopped.index, nested=False)
    assert not alone.compared and "stopped training inside this step" in alone.nothing_compared
    assert not alone.match and alone.stopped  # nothing checked is no match
    # pdbg replay says so, exit 1 (it said "the step returned no tensor", exit 0, under an empty table header)
    cli = pdbg_here("replay", str(run_path), str(stopped.index), "--no-inner", cwd=run_path.parent)
    assert cli.returncode == 1 and cli.stdout.rstrip().endswith(
        "NOTHING COMPARED: the recording stopped training inside this step, so it returned no output, and no step "
        "inside it was compared (--no-inner)"), cli.stdout + cli.stderr
    assert "recorded: min" not in cli.stdout
    both = pdbg_here("replay", str(run_path), str(stopped.index), cwd=run_path.parent)
    assert both.returncode == 0 and "inner steps: 1 of 1 match" in both.stdout and "recorded: min" not in both.stdout
    origin = replayer.first_nonfinite(rec, ops=True)
    assert origin.step.name == "smooth_relu" and origin.op is not None and origin.op.name == "aten::exp"
    assert origin.op_note is None


class TestChecks:
    def test_check_marks_alerts_on_the_steps_it_fails(self, run_path: Path) -> None:
        """A registered check that returns a message marks exactly those steps alert."""
        @recorder.register_check("positive mean")
        def positive(step: recorder.StepContext) -> bool | str:
            mean = step.stats["output"]["mean"]
            return mean > 0 or f"mean {mean:.1f} is not positive"

        with recorder.record(run_path) as run:
            for v in (1.0, -2.0, 3.0):
                root(torch.tensor([v * v])) if v > 0 else smooth_relu(torch.tensor([v]), gamma=-1.0)
                run.next_iteration()
        assert alerts(run_path) == [(1, ["mean -0.3 is not positive"])]
        assert [s[1] for s in statuses(run_path)] == ["ok", "alert", "ok"]

    def test_a_check_and_a_breakpoint_are_shown_by_what_they_said(self, run_path: Path) -> None:
        """`pdbg info`, the TUI's alerts pane and a notebook show a check's message and a breakpoint's
        name (they were shown as a broken watch: "watch None: ... expected None, got None")."""
        import replayer
        from tests.cli import pdbg_here
        from tui import views

        recorder.register_check("positive mean")(lambda step: step.stats["output"]["mean"] > 0 or "not positive")
        recorder.breakpoint("Eq. 2", lambda step: True, "record", name="every")
        with recorder.record(run_path):
            smooth_relu(torch.tensor([-9.0]), gamma=-1.0)
        want = ["check 'positive mean': not positive", "breakpoint 'every' fired"]
        proc = pdbg_here("info", str(run_path), cwd=run_path.parent)
        out = proc.stdout
        assert proc.returncode == 0 and all(f"  step 0 (smooth_relu, iteration 0): {w}" in out for w in want), out
        assert "watch" not in out
        with replayer.open(run_path) as rec:
            assert [r.text.rsplit("call 0: ", 1)[1] for r in views.alerts(rec)] == want
            page = rec.step(0)._repr_html_()
        assert all(html.escape(w) in page for w in want) and "watch None" not in page

    def test_alerts_on_a_nonfinite_step_are_counted_and_listed(self, run_path: Path) -> None:
        """A step that goes NaN and breaks a watch is `nonfinite`, and keeps its alert: `pdbg info`
        counts it and the TUI's alerts pane lists it (both saw status `alert` only)."""
        import replayer
        from tests.cli import pdbg
        from tui import views

        @recorder.paper_step("Eq. 6")
        def watched_root(x: torch.Tensor) -> torch.Tensor:
            return recorder.watch(x.sqrt(), "root", expected_range=(0.0, 3.0))

        with recorder.record(run_path) as run:
            for v in (4.0, -1.0):
                watched_root(torch.tensor([v, 1.0]))
                run.next_iteration()
        assert [s[1] for s in statuses(run_path)] == ["ok", "nonfinite"]
        info = pdbg("info", str(run_path), "--json", cwd=run_path.parent)
        assert info.returncode == 0 and json.loads(info.stdout)["alerts"] == 1
        rows = [(r.index, r.kind) for r in views.alerts(replayer.open(run_path))]
        assert rows == [(1, "origin"), (1, "alert")]
        assert "watch root: range expected [0.0, 3.0], got [1.0, 1.0] and 1 NaN/Inf" in \
            views.alerts(replayer.open(run_path))[1].text

    def test_a_check_that_raises_is_reported_on_the_step(self, run_path: Path) -> None:
        """A broken check does not stop training; its error shows as an alert."""
        recorder.register_check("broken")(lambda step: step.stats["missing"])
        with recorder.record(run_path):
            root(torch.tensor([4.0]))
        assert alerts(run_path) == [(0, ["the check raised KeyError: 'missing'"])]

    def test_unregistered_check_no_longer_runs(self, run_path: Path) -> None:
        recorder.register_check("never")(lambda step: False)
        recorder.unregister_check("never")
        with recorder.record(run_path):
            root(torch.tensor([4.0]))
        assert alerts(run_path) == []


def identity_blocks() -> nn.Module:
    model = nn.Sequential(*(nn.Linear(2, 2) for _ in range(3)))
    with torch.no_grad():
        for layer in model:
            layer.weight.copy_(torch.eye(2))
            layer.bias.zero_()
    return model


SCALES = (1.0, 200.0, 3.0, 500.0, 50.0)  # block 1's output abs-max is over 100 at iterations 1 and 3


def train_scaled(model: nn.Module, run: object) -> None:
    for scale in SCALES:
        model(torch.full((1, 2), scale))
        run.next_iteration()  # type: ignore[attr-defined]


class TestBreakpoints:
    def test_record_fires_exactly_where_the_condition_holds(self, run_path: Path) -> None:
        """A breakpoint on the second block with 'output abs-max > 100' alerts at iterations 1 and 3 only."""
        bp = recorder.breakpoint("1", lambda step: step.stats["output"]["absmax"] > 100, "record", name="big")
        with recorder.record(run_path, modules="*") as run:
            train_scaled(identity_blocks(), run)
        assert alerts(run_path) == [(1, ["breakpoint 'big' fired"]), (3, ["breakpoint 'big' fired"])]
        assert bp.hits == 2

    def test_stop_raises_at_the_first_hit(self, run_path: Path) -> None:
        """action='stop' flushes and raises BreakpointStop at the first iteration where it holds."""
        recorder.breakpoint("1", lambda step: step.stats["output"]["absmax"] > 100, "stop")
        with pytest.raises(recorder.BreakpointStop, match=r"^breakpoint '1' at Linear at 1 forward, iteration 1, "
                                                           r"call 1$"), \
                recorder.record(run_path, modules="*") as run:
            train_scaled(identity_blocks(), run)
        got = [(s[2], s[1]) for s in statuses(run_path)]
        assert got[-2:] == [(1, "ok"), (1, "alert")] and len(got) == 5

    def test_pdb_opens_the_debugger_at_each_hit(self, run_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """action='pdb' opens pdb in the caller's frame, at iterations 1 and 3, and training goes on."""
        import pdb

        frames = []
        monkeypatch.setattr(pdb.Pdb, "set_trace", lambda self, frame=None: frames.append(frame))
        recorder.breakpoint("1", lambda step: step.stats["output"]["absmax"] > 100, "pdb")
        with recorder.record(run_path, modules="*") as run:
            train_scaled(identity_blocks(), run)
        assert len(frames) == 2
        assert [f.f_code.co_name for f in frames] == ["train_scaled", "train_scaled"]  # past torch's own frames
        assert [it for it, _ in alerts(run_path)] == [1, 3]

    def test_selector_by_label_iteration_and_phase(self, run_path: Path) -> None:
        """Selectors: paper label, @iter=K and :backward narrow where a breakpoint applies."""
        fwd = recorder.breakpoint("Eq. 5@iter=1")
        bwd = recorder.breakpoint("root:backward")
        with recorder.record(run_path) as run:
            for v in (1.0, 4.0, 9.0):
                root(torch.tensor([v], requires_grad=True)).sum().backward()
                run.next_iteration()
        assert (fwd.hits, bwd.hits) == (1, 3)

    def test_bad_selector_and_action(self) -> None:
        with pytest.raises(RecordingError, match="unknown breakpoint action"):
            recorder.breakpoint("x", action="halt")
        with pytest.raises(RecordingError, match="invalid step selector"):
            recorder.breakpoint("")


NAN_SCRIPT = """
import torch
import recorder

@recorder.paper_step("Eq. 2", description="SmoothReLU")
def smooth_relu(x):
    return torch.log1p(torch.exp(x + 1.0))

for i in range(4):
    y = smooth_relu(torch.tensor([50.0 * i, 1.0]))  # exp(101) overflows at i=2
    print("iteration", i, "ok")
"""


class TestPdbgRecordOnAnomaly:
    def _run(self, tmp_path: Path, action: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
        script = tmp_path / "nan.py"
        script.write_text(NAN_SCRIPT)
        import os

        env = dict(os.environ, PYTHONPATH=str(ROOT))
        return subprocess.run([sys.executable, "-m", "tui.cli", "record", "-o", "run.zarr", "--on-anomaly", action,
                               "--", str(script)], cwd=tmp_path, input=stdin, capture_output=True, text=True,
                              timeout=300, check=False, env=env)

    def test_stop(self, tmp_path: Path) -> None:
        """`--on-anomaly stop`: the script dies with NonFiniteError naming the step; the run is crashed."""
        proc = self._run(tmp_path, "stop")
        assert proc.returncode == 1
        assert proc.stdout.splitlines() == ["iteration 0 ok", "iteration 1 ok"]
        assert ("recorder.monitors.NonFiniteError: Eq. 2 (smooth_relu) forward, iteration 0, call 2: output has "
                "1 Inf") in proc.stderr
        assert RunReader(str(tmp_path / "run.zarr")).status == "crashed"

    def test_pdb(self, tmp_path: Path) -> None:
        """`--on-anomaly pdb`: pdb opens in the script at the anomaly; 'c' lets it finish."""
        proc = self._run(tmp_path, "pdb", stdin="p i\nc\nc\n")
        assert proc.returncode == 0, proc.stderr
        assert "(Pdb) 2" in proc.stdout and "iteration 3 ok" in proc.stdout
        assert "pdbg: Eq. 2 (smooth_relu) forward, iteration 0, call 2: output has 1 Inf; opening pdb" in proc.stderr


@recorder.paper_step("Eq. 40", description="inverse-frequency class weights, in numpy")
def np_class_weights(counts: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        w = counts.sum() / (counts * len(counts))
        return w / w.sum()  # a zero count: inf / inf = nan


def test_stop_at_a_nan_a_step_made_in_numpy(run_path: Path) -> None:
    """on_anomaly='stop' stops at the step whose numpy result holds NaN, not at the step that uses it."""
    with pytest.raises(recorder.NonFiniteError) as info, recorder.record(run_path, on_anomaly="stop") as run:
        for it in range(3):
            w = np_class_weights(np.array([1.0, 2.0, 0.0 if it == 1 else 3.0]))
            smooth_relu(torch.as_tensor(w, dtype=torch.float32))
            run.next_iteration()
    assert str(info.value) == ("Eq. 40 (np_class_weights) forward, iteration 1, call 0: output (numpy float64[3]) "
                               "has 1 NaN of 3")
    assert statuses(run_path)[-1] == ("np_class_weights", "nonfinite", 1)


@recorder.paper_step("Eq. 44", description="raw class weights, watched")
def np_watched_weights(counts: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        w = counts.sum() / counts
    recorder.watch(w, "raw_weights", expected_range=(0, 10))
    return np.nan_to_num(w, posinf=1.0)


def test_watch_checks_a_numpy_array(run_path: Path) -> None:
    """watch() on a numpy intermediate checks its expectations as on a tensor: Inf breaks a range."""
    with recorder.record(run_path) as run:
        for it in range(2):
            np_watched_weights(np.array([1.0, 2.0, 0.0 if it == 1 else 3.0]))
            run.next_iteration()
    rank = RunReader(str(run_path)).rank(0)
    extras = [int(e) for e in rank.column("steps/extra")]
    got = [(int(rank.column("steps/iteration")[i]), a) for i, e in enumerate(extras) if e >= 0
           for a in rank.doc(e).get("alerts", [])]
    assert [(it, a["watch"], a["check"], a["nonfinite"]) for it, a in got] == [(1, "raw_weights", "range", 1)]
