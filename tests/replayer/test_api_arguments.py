"""The Python API driven from a notebook or a script: every entry point takes a recording or its path, a
Step is taken only by its own recording, and arguments of the wrong kind are one-line PdbgErrors, never an
AttributeError or a numpy error from inside."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import recorder
import replayer
from recorder.errors import PdbgError, RecordingError, ReplayError, StepNotFoundError
from tests.models import poison_at, record_training


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two runs of TinyGPT: three iterations with a NaN written into a weight at the third, and one clean."""
    root = tmp_path_factory.mktemp("api")
    record_training(root / "a.zarr", 3, poison_at(2))
    record_training(root / "b.zarr", 1)
    return root / "a.zarr", root / "b.zarr"


class TestPaths:
    def test_every_entry_point_takes_a_path(self, runs, tmp_path):
        """first_nonfinite, first_divergence, find and bundle take a path, as replay does."""
        a, b = runs
        rec = replayer.open(a)
        origin = replayer.first_nonfinite(str(a))
        assert origin.entered is not None and origin.cause == replayer.first_nonfinite(rec).cause
        assert replayer.first_divergence(str(a), b).cause == \
            replayer.first_divergence(rec, replayer.open(b)).cause
        assert replayer.find(a, "smooth_relu@iter=1", None).index == rec.step("smooth_relu@iter=1").index
        info = replayer.bundle(str(a), "smooth_relu@iter=1", tmp_path / "f.pdbg")
        assert len(replayer.open(info.path)) == 1


class TestStepsOfAnotherRun:
    def test_a_step_of_another_recording_is_refused(self, runs, tmp_path):
        """A Step of run A given with run B is refused in one line, not replayed or bundled from run A."""
        a, b = runs
        rec_a, rec_b = replayer.open(a), replayer.open(b)
        step = rec_a.step(len(rec_a) - 1)
        assert step.index >= len(rec_b)  # (run B has no such step at all)
        for call in (lambda: replayer.replay(rec_b, step), lambda: replayer.bundle(rec_b, step, tmp_path / "x.pdbg"),
                     lambda: rec_b.step(step), lambda: replayer.find(rec_b, None, None, start=step)):
            with pytest.raises(StepNotFoundError, match=rf"^step {step.index} \(.*\) is a step of .*a\.zarr, not of "
                                                        r".*b\.zarr: give it with its own recording"):
                call()
        assert not (tmp_path / "x.pdbg").exists()

    def test_the_same_run_opened_again_takes_its_steps(self, runs):
        """The same path opened twice: a step of one is a step of the other (a notebook that reopens a run)."""
        a, _ = runs
        first, again = replayer.open(a), replayer.open(a)
        step = first.step("smooth_relu@iter=0")
        assert again.step(step) is step
        assert replayer.replay(again, step).match


class TestWrongArguments:
    def test_step_named_by_something_else(self, runs):
        """rec.step takes an int, a numpy or 0-d tensor integer, or a selector; anything else is one line."""
        rec = replayer.open(runs[0])
        assert rec.step(np.int64(3)).index == rec.step(torch.tensor(3)).index == 3
        for bad, shown in ((1.5, "float 1.5"), (None, "NoneType None"), (True, "the bool True"), ([1], "list [1]")):
            with pytest.raises(RecordingError, match=rf"^a step is named by its index \(an int\) or a selector .*"
                                                     rf"not {re.escape(shown)}$"):
                rec.step(bad)

    def test_tensor_named_by_something_else(self, runs):
        """step.tensor and step.why_statistics_only take a record name; another type is one line."""
        step = replayer.open(runs[0]).step("smooth_relu@iter=0")
        for bad in (0, None):
            with pytest.raises(StepNotFoundError, match=r"^a tensor of step \d+ is named by its record name, a str "
                                                        r"\(it has input:args.0, output:output\), not "):
                step.tensor(bad)
        assert step.why_statistics_only("args.0") == step.why_statistics_only(step.records[0])
        with pytest.raises(StepNotFoundError, match="has no tensor 'args.9'"):
            step.why_statistics_only("args.9")

    def test_step_table_positions(self, runs):
        """A position beyond the table is a PdbgError that is an IndexError too; a name is pointed at select."""
        rec = replayer.open(runs[0])
        table = rec.steps.filter(name="smooth_relu")
        assert table[-1].index == table.rows[-1]
        with pytest.raises(IndexError, match=rf"^position {len(table)} is out of range: the table has {len(table)} "
                                             rf"steps; a step by its index: rec.step\({len(table)}\)$") as caught:
            table[len(table)]
        assert isinstance(caught.value, PdbgError)
        with pytest.raises(RecordingError, match=r"^a step table is indexed by position .* not str 'smooth_relu'; "
                                                 r"steps by name: \.select\(SELECTOR\)"):
            rec.steps["smooth_relu"]

    def test_filter_numbers_given_as_text(self, runs):
        """filter(iteration="1") is refused, not an empty table."""
        rec = replayer.open(runs[0])
        assert len(rec.steps.filter(iteration=np.int64(1))) == len(rec.steps.filter(iteration=1)) > 0
        for field in ("iteration", "call", "object"):
            with pytest.raises(RecordingError, match=rf"^filter {field}='1': give an integer \(a str matches no "
                                                     r"step\)$"):
                rec.steps.filter(**{field: "1"})

    def test_find_from_a_start_it_does_not_have(self, runs):
        """A start beyond the recording is refused, named as given, not taken for "nothing after it"."""
        rec = replayer.open(runs[0])
        for start in (len(rec) + 10, -5):
            with pytest.raises(StepNotFoundError, match=rf"^step {start} is out of range"):
                replayer.find(rec, None, "output.max > 0", start=start)

    def test_threads_that_are_no_thread_count(self, runs):
        """replay(threads=...) other than an int from 1 to MAX_THREADS is refused before the replay, in one line
        (10**9 was accepted, with the warnings "not applied" and "replayed with 1000000000 (forced)")."""
        rec = replayer.open(runs[0])
        for bad in (0, -3, "2", 2.5, True, 10**9):
            with pytest.raises(ReplayError, match=rf"^threads={bad!r}: give a number of intra-op threads from 1 to "):
                replayer.replay(rec, "smooth_relu@iter=0", threads=bad)
        threads = torch.get_num_threads()
        res = replayer.replay(rec, "smooth_relu@iter=0", threads=np.int64(1))
        assert res.match and torch.get_num_threads() == threads


def test_a_replay_result_says_in_one_line_what_an_intervention_did(runs):
    """repr(ReplayResult) words a replay as pdbg replay does: an edit that changes the output is no plain
    MISMATCH, one that changes nothing is NO CHANGE; and it counts outputs, not "1 tensors"."""
    rec = replayer.open(runs[0])
    step = rec.step("smooth_relu@iter=0")
    assert repr(replayer.replay(rec, step)) == f"<ReplayResult step {step.index}: match, 1 output compared>"
    assert repr(replayer.replay(rec, step, edit={"args.0": "x * 0"})) == \
        f"<ReplayResult step {step.index}: MISMATCH, as the intervention makes it, 1 output compared>"
    assert repr(replayer.replay(rec, step, edit={"args.0": "x"})) == \
        f"<ReplayResult step {step.index}: NO CHANGE, 1 output compared>"


class _Memory:
    """A DQN's replay memory, passed whole to the step that samples from it."""

    def __init__(self, n: int) -> None:
        self.data = [(np.full(4, i, np.float32), float(i)) for i in range(n)]


@recorder.paper_step("Algorithm 1", step=5, description="sample a minibatch from the replay memory D")
def sample_batch(memory: _Memory, k: int) -> torch.Tensor:
    return torch.from_numpy(np.stack([memory.data[i][0] for i in range(k)]))


class _Lookup(torch.nn.Module):
    """A module holding a long list as an attribute (encoded once, with its skeleton: kept as data)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.table = list(range(n))
        self.proj = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) + self.table[-1]


def test_a_replay_memory_given_whole_is_a_placeholder_and_a_long_module_attribute_stays_data(tmp_path) -> None:
    """sample_batch(memory, k) with 5,000 transitions in memory.data: the list was taken apart into the step's
    arguments at every call (20,000 transitions: 2 s a call). It is a placeholder now, the warning and the
    replay's refusal say why; a module's long list attribute, encoded once, is still data and replays."""
    memory, lookup = _Memory(5000), _Lookup(5000)
    path = tmp_path / "dqn.zarr"
    with pytest.warns(Warning, match=r"sample_batch was given memory\.data, a list of 5,000 items, over the 4,096 "
                                     r"items recorded as data"):
        with recorder.record(path, model=lookup, modules=["**"]) as run:
            lookup(sample_batch(memory, 8)).sum().backward()
            run.next_iteration()
    rec = replayer.open(path)
    steps = {rec.step(i).name: rec.step(i) for i in range(len(rec)) if rec.step(i).phase == "forward"}
    data = steps["sample_batch"].arguments["args"][0]["$object"]["fields"]["data"]
    assert data == {"$opaque": {"type": "builtins:list", "repr": "<list of 5000 items>"}}
    with pytest.raises(ReplayError, match="a list of 5,000 items, over the 4,096 items recorded as data"):
        replayer.replay(rec, steps["sample_batch"].index)
    assert replayer.replay(rec, steps["_Lookup"].index).match
