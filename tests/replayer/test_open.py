"""replayer.open: the step table (length, slicing, filters, selectors, numpy columns) and one step's
tensors, arguments, RNG, settings, source and environment."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import replayer
from recorder.errors import NotARecordingError, RecordingError, StepNotFoundError
from tests.models import record_training, smooth_relu

ITERATIONS = 3


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    path = tmp_path_factory.mktemp("open") / "run.zarr"
    rng_at_first_step = []
    record_training(path, ITERATIONS, lambda i, _: rng_at_first_step.append(torch.get_rng_state()) if i == 1 else None)
    return replayer.open(path), rng_at_first_step


class TestStepTable:
    def test_length_slicing_and_columns(self, recorded):
        """len, slices and integer indexing; columns are numpy arrays in execution order."""
        rec, _ = recorded
        steps = rec.steps
        assert len(steps) == len(rec) == ITERATIONS * 12
        assert isinstance(steps.column("iteration"), np.ndarray)
        assert list(steps.column("index")) == list(range(len(steps)))
        assert len(steps[:5]) == 5 and steps[3].index == 3 and steps[-1].index == len(steps) - 1
        assert sorted(set(steps.column("iteration"))) == list(range(ITERATIONS))

    def test_filters(self, recorded):
        """filter by name, paper label, phase, iteration and status narrows the table exactly."""
        rec, _ = recorded
        attn = rec.steps.filter(name="Attention")
        assert len(attn) == ITERATIONS * 2 * 2  # 2 layers, forward and backward
        assert len(rec.steps.filter(label="Eq. 2", phase="forward", iteration=1)) == 2
        assert set(rec.steps.filter(phase="backward").column("phase")) == {1}
        assert len(rec.steps.filter(status="ok")) + len(rec.steps.filter(status="alert")) == len(rec)

    def test_selectors(self, recorded):
        """NAME[@iter=K][#CALL][:backward] by step name, paper label and module path."""
        rec, _ = recorded
        second = rec.steps.select("smooth_relu@iter=1#1")  # the step's second call in the iteration, wherever
        assert [(s.name, s.iteration, s.call, s.phase, s.module_path) for s in second] == \
            [("smooth_relu", 1, 1, "forward", "h.1.mlp")]
        both = rec.steps.select("smooth_relu@iter=1")
        assert [(s.call, s.module_path) for s in both] == [(0, "h.0.mlp"), (1, "h.1.mlp")]
        assert rec.step("smooth_relu@iter=1").index == both[0].index  # the first match
        assert rec.step('Eq. 2@iter=2').module_path == "h.0.mlp"
        back = rec.step("h.1.attn@iter=0:backward")
        assert (back.name, back.phase, back.forward) == ("Attention", "backward", rec.step("h.1.attn@iter=0").index)
        assert len(rec.steps.select("h.*")) == ITERATIONS * 2  # the blocks' forward calls
        assert rec.step("7").index == 7

    def test_bad_selectors_are_one_line_errors(self, recorded):
        """Out of range, no match, unknown filter values and malformed selectors: one line each."""
        rec, _ = recorded
        with pytest.raises(StepNotFoundError, match=r"^step 999 is out of range: .* has 36 steps \(0..35\)$"):
            rec.step(999)
        with pytest.raises(StepNotFoundError, match="no step matches 'nothing@iter=1'; names in this recording: "):
            rec.step("nothing@iter=1")
        with pytest.raises(RecordingError, match="^unknown phase 'sideways': use one of forward, backward$"):
            rec.steps.filter(phase="sideways")
        with pytest.raises(RecordingError, match="^invalid step selector '@iter=3'"):
            rec.step("@iter=3")


class TestStep:
    def test_tensors_are_the_exact_recorded_values(self, recorded):
        """A step's output is bitwise its consumer's recorded input (smooth_relu gets the MLP input)."""
        rec, _ = recorded
        step = rec.step("smooth_relu@iter=0#0")
        x = step.tensor("args.0")
        assert torch.equal(step.tensor("output"), smooth_relu.__wrapped__(x, **step.arguments["kwargs"]))
        roles = {r.role for r in step.records}
        assert roles == {"input", "output"}
        attn = rec.step("h.0.attn@iter=0")
        assert {r.name for r in attn.tensors("param")} >= {"qkv.weight", "proj.weight"}

    def test_tensor_by_role_and_name_as_the_refusal_lists_it(self, recorded):
        """step.tensor("param_grad:NAME") is the record the step's refusal lists so, not a refusal naming it."""
        rec, _ = recorded
        back = rec.step("h.0.attn@iter=0:backward")
        grad = next(r for r in back.tensors("param_grad"))
        by_role = back.tensor(f"param_grad:{grad.name}")
        assert torch.equal(by_role.view(torch.int32), back.tensor(grad.name, role="param_grad").view(torch.int32))
        with pytest.raises(StepNotFoundError, match=r"has no tensor 'param_grad:nothing'; it has .*param_grad:"):
            back.tensor("param_grad:nothing")

    def test_arguments_settings_source_and_environment(self, recorded):
        """Arguments as tagged JSON, settings at entry, the code's source and the run's environment."""
        rec, _ = recorded
        step = rec.step("smooth_relu@iter=0#0")
        assert step.arguments == {"args": [{"$tensor": "args.0"}], "kwargs": {"beta": 0.5}}
        assert step.settings["num_threads"] == torch.get_num_threads()
        assert "def smooth_relu" in step.source and step.definition["ref"] == "tests.models:smooth_relu"
        assert step.environment["torch"] == torch.__version__
        assert step.paper == {"label": "Eq. 2", "algorithm": None, "step": None, "equation": None,
                              "description": "SmoothReLU(x) = log(1 + exp(x + beta)) / gamma"}

    def test_rng_decodes_to_the_state_at_step_entry(self, recorded):
        """The torch CPU state recorded at iteration 1's first step is the one the training loop had."""
        rec, (state,) = recorded
        first = rec.steps.filter(iteration=1)[0]
        rng = first.rng
        assert torch.equal(rng["torch"], state)
        assert set(rng) >= {"torch", "numpy", "python"}

    def test_step_object_json(self, recorded):
        """to_json gives the README's JSON step object."""
        rec, _ = recorded
        obj = rec.step("h.1.attn@iter=2:backward").to_json()
        assert obj == {"index": obj["index"], "rank": 0, "name": "Attention", "phase": "backward", "iteration": 2,
                       "call": 1, "module_path": "h.1.attn",
                       "paper": {"label": "Eq. 1", "algorithm": "Algorithm 1", "step": 3, "equation": None,
                                 "description": "causal self-attention"}, "status": obj["status"],
                       "grad_enabled": True, "object": None, "objects": None}
        assert obj["status"] in ("ok", "alert")


def test_not_a_recording(tmp_path):
    """A path that does not exist is the recorder's one-line NotARecordingError."""
    with pytest.raises(NotARecordingError):
        replayer.open(tmp_path / "missing.zarr")
