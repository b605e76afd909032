"""Replay: every step of a recorded GPT-like run again, alone, bit for bit, forward and backward;
the caller's RNG and settings untouched; modules rebuilt without their ``__init__``; code drift,
thread counts and bad input reported."""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr
from torch import nn

import recorder
import replayer
from recorder import capture, jsonval, snapshot
from recorder.errors import FormatError, ReplayError, StepNotFoundError
from recorder.store import layout
from replayer.bisect import describe
from replayer.intervene import InterventionError
from replayer.rebuild import Builder
from replayer.replay import NOTHING_COMPARED, Replayer, known_refusal
from tests.cli import SCRIPTS, env, pdbg, pdbg_here, python
from tests.models import poison_at, record_data_write, record_training
from tests.replayer.kinds import TreeEncoder

ITERATIONS = 3
STEPS_PER_PASS = 7  # per iteration: 2 x (Block, Attention, smooth_relu) + Mixer, forward and again backward


def record_gpt(where: Path, iterations: int = ITERATIONS) -> Path:
    """`pdbg record --modules mixer` of a private copy of tests/scripts/gpt_train.py; returns the run."""
    script = where / "gpt_train.py"
    shutil.copy(SCRIPTS / "gpt_train.py", script)
    res = pdbg_here("record", "-o", "run.zarr", "--modules", "mixer", "--", str(script), str(iterations), cwd=where)
    assert res.returncode == 0, res.stderr
    return where / "run.zarr"


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return record_gpt(tmp_path_factory.mktemp("gpt"))


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.detach().contiguous().view(torch.uint8), b.detach().contiguous().view(torch.uint8))


def test_verify_says_how_the_environment_differs(gpt_run: Path, tmp_path: Path) -> None:
    """Replayed with another CPU capability than recorded, verify said nothing of it (a replay of one
    step did): a few-ULP mismatch read as the code's."""
    import subprocess
    import sys

    from tests.cli import env

    environment = {**env(), "ATEN_CPU_CAPABILITY": "default"}
    recorded = replayer.open(gpt_run).step(0).settings.get("cpu_capability")
    assert recorded not in (None, "DEFAULT"), recorded  # (a machine with vector units recorded it)
    res = subprocess.run([sys.executable, "-m", "tui.cli", "verify", str(gpt_run), "--sample", "1", "--json"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300, env=environment, check=False)
    differences = json.loads(res.stdout)["environment_differences"]
    assert any("CPU capability" in d and "DEFAULT" in d for d in differences), differences
    text = subprocess.run([sys.executable, "-m", "tui.cli", "verify", str(gpt_run), "--sample", "1"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env=environment, check=False).stdout
    assert "\nenvironment differs from the recording: " in text and "CPU capability" in text, text


def test_verify_in_a_fresh_process_replays_every_step_bitwise(gpt_run: Path, tmp_path: Path) -> None:
    """`pdbg verify` from another directory: every forward and backward step matches bit for bit,
    and loading the script's code did not run its training."""
    res = pdbg_here("verify", str(gpt_run), "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "TRAINED" not in res.stdout
    doc = json.loads(res.stdout)
    total = 2 * STEPS_PER_PASS * ITERATIONS
    assert doc == {"replayed": total, "matched": total, "mismatches": [], "not_replayed": [],
                   "environment_differences": []}
    phases = replayer.open(gpt_run).steps.column("phase")
    assert (phases == 0).sum() == (phases == 1).sum() == STEPS_PER_PASS * ITERATIONS


def test_forward_replay_gives_the_recorded_bits_and_checks_inner_steps(gpt_run: Path) -> None:
    rec = replayer.open(gpt_run)
    step = rec.step("Block@iter=1#1")
    res = replayer.replay(rec, step)
    assert res.match and [d.name for d in res.outputs] == ["output"]
    assert res.diffs["output"].max_ulp == 0 and res.diffs["output"].mismatched == 0
    assert bits_equal(res.values["output"], step.tensor("output"))
    assert [(s.step.name, s.step.module_path, s.match) for s in res.inner] == [
        ("Attention", "blocks.1.attn", True), ("smooth_relu", "blocks.1", True)]
    assert res.first_divergence is None and res.warnings == [] and res.environment_differences == []


def test_backward_replay_recomputes_grad_inputs_and_parameter_grads(gpt_run: Path) -> None:
    rec = replayer.open(gpt_run)
    step = rec.step("Block@iter=2#0:backward")
    res = replayer.replay(rec, step)
    names = {d.name: d.role for d in res.outputs}
    assert names["args.0"] == "grad_input" and names["ln1.weight"] == "param_grad"
    params = {r.name for r in rec.step(step.forward).tensors("param")}
    assert len(params) == 13 and set(names) == {"args.0", *params}  # the input, and every parameter
    assert res.match and all(d.match and d.max_ulp == 0 for d in res.outputs)
    assert bits_equal(res.values["param_grad:ln1.weight"], step.tensor("ln1.weight", role="param_grad"))
    # The inner steps' backward, in execution order (the reverse of the forward), each compared.
    assert [(s.step.name, s.step.phase, s.match) for s in res.inner] == [
        ("smooth_relu", "backward", True), ("Attention", "backward", True)]
    attention = {(d.role, d.name) for d in res.inner[1].diffs}
    assert {("grad_output", "output"), ("grad_input", "args.0"), ("param_grad", "qkv.weight")} <= attention


def test_modules_are_rebuilt_without_their_init_or_through_their_constructor(gpt_run: Path) -> None:
    """Attention (config dataclass), Gate (ints, floats, a tuple, a flag) and Block come back from
    their skeletons, their __init__ never called; Mixer (self.f = lambda ...; a plain config class,
    recorded by pdbg record) is rebuilt by calling its constructor, and says so."""
    rec = replayer.open(gpt_run)
    rep = Replayer(rec)
    block = rec.step("Block@iter=0#0")
    res = rep.replay(block)
    assert res.match and set(res.rebuilt.values()) == {"skeleton"} and "blocks.0.gate" in res.rebuilt
    main = rep.loader.main()
    assert main.INIT_CALLS == {"Attention": 0, "Gate": 0, "Block": 0, "Mixer": 0}
    module = Builder(rep.loader).build(block._doc("module"), "blocks.0").module
    assert type(module.attn.cfg) is main.GPTConfig and module.attn.cfg == main.GPTConfig()
    gate = module.gate
    assert (gate.width, gate.eps, gate.shape, gate.use_bias) == (16, 1e-5, (1, 1, 16), True)
    assert type(gate.shape) is tuple and module.training and module.drop.p == 0.1

    mixer = rep.replay("mixer@iter=1")
    assert mixer.match and mixer.rebuilt == {"mixer": "constructor", "mixer.sub": "constructor"}
    assert main.INIT_CALLS["Mixer"] == 1  # built once, by its constructor, from the recorded config
    backward = rep.replay("mixer@iter=1:backward")
    assert backward.match and {d.name for d in backward.outputs} == {"args.0", "sub.weight", "sub.bias"}


def test_replay_leaves_the_callers_rng_and_settings_alone(gpt_run: Path) -> None:
    """The caller runs 1 thread with deterministic algorithms and its own seeds; replays (dropout,
    2 recorded threads, backward) match bitwise and leave every state as the caller had it."""
    rec = replayer.open(gpt_run)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.manual_seed(123)
        np.random.seed(5)
        random.seed(7)
        before = (torch.get_rng_state().clone(), np.random.get_state(), random.getstate(), snapshot.settings())
        for selector in ("Attention@iter=1#0", "Block@iter=1#1:backward", "mixer@iter=2"):
            assert replayer.replay(rec, selector).match, selector
        after = (torch.get_rng_state(), np.random.get_state(), random.getstate(), snapshot.settings())
        assert torch.equal(before[0], after[0])
        assert before[1][0] == after[1][0] and np.array_equal(before[1][1], after[1][1])
        assert before[1][2:] == after[1][2:]
        assert before[2] == after[2] and before[3] == after[3]
        assert torch.get_num_threads() == 1 and torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
        torch.set_num_threads(threads)


@recorder.paper_step("Eq. 23", description="a step that changes process-wide settings and leaves them so")
def leaves_settings(x: torch.Tensor) -> torch.Tensor:
    torch.set_default_dtype(torch.float64)
    torch.use_deterministic_algorithms(True)
    torch.set_float32_matmul_precision("medium")
    torch.set_num_threads(1)
    return x * 2


def test_settings_the_replayed_step_changes_itself_are_the_callers_again_afterwards(tmp_path: Path) -> None:
    """Only the settings the replay applied (where the recording's differed from the caller's) were
    put back: a step that set the default dtype, deterministic algorithms, matmul precision and
    the thread count itself left them so in the caller's process (a notebook, the TUI)."""
    from replayer import state

    path = tmp_path / "run.zarr"
    threads, entry = torch.get_num_threads(), snapshot.settings()
    try:
        with recorder.record(path):
            leaves_settings(torch.randn(3))
        torch.set_default_dtype(torch.float32)
        torch.use_deterministic_algorithms(False)
        torch.set_float32_matmul_precision("highest")
        torch.set_num_threads(2)
        before = snapshot.settings()
        assert replayer.replay(path, 0).match
        assert snapshot.settings() == before
        assert torch.get_default_dtype() == torch.float32 and torch.get_num_threads() == 2
    finally:
        torch.set_default_dtype(torch.float32)
        torch.use_deterministic_algorithms(False)
        torch.set_float32_matmul_precision("highest")
        torch.set_num_threads(threads)
        state._restore_precision(entry)  # (the legacy setter moves torch's newer precision settings too)


@recorder.paper_step("Eq. 9")
def project(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w


@pytest.mark.parametrize("around", ["inference_mode", "no_grad", "autocast", "default_device", "default_dtype"])
def test_replay_inside_the_callers_modes_runs_as_recorded(gpt_run: Path, around: str) -> None:
    """A replay called inside torch.inference_mode(), torch.no_grad(), torch.autocast("cpu",
    bfloat16), under another default device ("meta" here: any machine has it) or default dtype runs
    the step with the recorded call's modes, device and dtype: forward and backward match bitwise
    (the backward needs autograd, which the caller's inference mode refuses and no_grad kept from
    the inputs' copies, so that their gradients were lost; autocast would compute in bfloat16; the
    rebuilt module's own tensors would be made in float64), and the caller's come back."""
    rec = replayer.open(gpt_run)
    modes = {"inference_mode": torch.inference_mode, "default_device": lambda: torch.device("meta"),
             "autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16), "default_dtype": float64_default,
             "no_grad": torch.no_grad}
    with modes[around]():
        results = [replayer.replay(rec, s) for s in ("Attention@iter=1#0", "Block@iter=1#1:backward", "mixer@iter=2")]
        assert around != "default_dtype" or torch.get_default_dtype() == torch.float64  # the caller's, back
        assert torch.is_grad_enabled() == (around not in ("no_grad", "inference_mode"))
    assert all(r.match for r in results), [[d.summary() for d in r.outputs if not d.match] for r in results]


class Recurrent(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = torch.nn.LSTM(8, 8, batch_first=True, num_layers=2, bidirectional=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(x)[0]


def test_a_step_recorded_without_grad_replays_inside_inference_mode(tmp_path: Path) -> None:
    """A step recorded under torch.no_grad() (an LSTM then takes another kernel than with grad mode
    on) replays bitwise inside the caller's torch.inference_mode(): leaving the caller's inference
    mode must not turn grad mode back on for the call."""
    torch.manual_seed(0)
    model = Recurrent().eval()
    path = tmp_path / "run.zarr"
    with recorder.record(path, model=model, mode="full", modules=["lstm"]), torch.no_grad():
        model(torch.randn(2, 5, 8))
    rec = replayer.open(path)
    assert len(rec.steps) == 1
    with torch.inference_mode():
        result = replayer.replay(rec, 0)
    assert result.match, [d.summary() for d in result.outputs]


@recorder.paper_step("Alg. 11", description="attention over a preallocated KV cache, written in place")
class CachedAttention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = torch.nn.Linear(8, 8)
        self.kv = torch.nn.Linear(8, 16)

    def forward(self, x: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, t: int) -> torch.Tensor:
        k, v = self.kv(x).chunk(2, -1)
        kc[:, t:t + 1] = k if t != 3 else k / 0.0  # NaN/Inf written into the cache at call 3
        vc[:, t:t + 1] = v
        a = torch.softmax(self.q(x) @ kc[:, :t + 1].nan_to_num().transpose(1, 2), -1)
        return a @ vc[:, :t + 1]


@pytest.mark.parametrize("guard", ["inference_mode", "no_grad"])
def test_a_kv_cache_written_in_place_under_inference_mode_is_recorded(tmp_path: Path, guard: str) -> None:
    """Generation under torch.inference_mode() with a preallocated KV cache each call writes into in place:
    inference tensors have no version counter, and the recorder left them out of the inputs it records again
    as the call leaves them, so the cache's new rows were never recorded (under no_grad they are: after:args.1),
    a replay compared the output alone, and the NaN/Inf a call wrote into the cache (and hid from its output)
    was seen only when the next call took it, as if it came from outside. Now the inference tensors' kept bits
    tell: after:args.1 is recorded and replayed bit for bit, bisect names the call that wrote it, and the
    generation's results are the bits of an unrecorded run."""
    def generate(path: Path | None) -> torch.Tensor:
        torch.manual_seed(0)
        attn = CachedAttention().eval()
        with contextlib.ExitStack() as stack:
            if path is not None:
                stack.enter_context(recorder.record(path, model=attn))
            stack.enter_context(torch.inference_mode() if guard == "inference_mode" else torch.no_grad())
            kc, vc, x = torch.zeros(2, 6, 8), torch.zeros(2, 6, 8), torch.randn(2, 1, 8)
            for t in range(6):
                x = attn(x, kc, vc, t)
            return torch.cat([x.reshape(-1), kc.reshape(-1), vc.reshape(-1)]).clone()

    path = tmp_path / "run.zarr"
    plain, recorded = generate(None), generate(path)
    assert torch.equal(plain.view(torch.int32), recorded.view(torch.int32))
    rec = replayer.open(path)
    assert [r.name for r in rec.step(2).records if r.role == "output"] == ["output", "after:args.1", "after:args.2"]
    result = replayer.replay(rec, 2)
    assert result.match and {d.name for d in result.outputs} == {"output", "after:args.1", "after:args.2"}
    origin = replayer.first_nonfinite(rec)
    assert origin.step is not None and origin.step.index == 3, origin.cause
    assert "after:args.1" in origin.cause, origin.cause


class WeightDrop(torch.nn.Module):
    """AWD-LSTM's DropConnect: ``weights`` of ``module`` (an nn.LSTM) kept as parameters NAME_raw, and NAME set
    before each call to a dropout of it, a plain tensor, with the LSTM's _flat_weights."""

    def __init__(self, module: torch.nn.Module, weights: list[str], dropout: float = 0.3) -> None:
        super().__init__()
        self.module, self.weights, self.dropout = module, weights, dropout
        for w in weights:
            raw = getattr(module, w)
            del module._parameters[w]
            module.register_parameter(w + "_raw", torch.nn.Parameter(raw.data))
            module.__dict__[w] = raw.data.clone()

    def forward(self, *args: Any) -> Any:
        for w in self.weights:
            raw = getattr(self.module, w + "_raw")
            self.module.__dict__[w] = torch.nn.functional.dropout(raw, p=self.dropout, training=self.training)
        self.module._flat_weights = [getattr(self.module, n) for n in self.module._flat_weights_names]
        return self.module(*args)


class DropConnectLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(13, 8)
        self.rnn = WeightDrop(torch.nn.LSTM(8, 16), ["weight_hh_l0"])
        self.dec = torch.nn.Linear(16, 13)

    def forward(self, tok: torch.Tensor) -> torch.Tensor:
        return self.dec(self.rnn(self.emb(tok))[0])


def test_an_lstm_whose_weight_dropconnect_sets_replays_in_the_steps_around_it(tmp_path: Path) -> None:
    """AWD-LSTM's WeightDrop sets the LSTM's weight_hh_l0 (a plain tensor) and _flat_weights before each call:
    the rebuilt LSTM lacked _flat_weight_refs, so no step holding it replayed (AttributeError). The LSTM's lists
    of its weights are derived again as torch does: the steps around it, whose code sets that weight, replay
    bit for bit, forward and backward; the LSTM's own steps, whose weight the recording does not hold, are
    refused for that weight."""
    torch.manual_seed(0)
    model = DropConnectLM()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    path = tmp_path / "run.zarr"
    outputs = []
    with pytest.warns(recorder.RecorderWarning, match="holds weight_hh_l0, a torch:Tensor"), \
            recorder.record(path, model=model, optimizer=opt, mode="full", modules=["**"]):
        for _ in range(2):
            out = model(torch.randint(0, 13, (5, 3)))
            outputs.append(out.detach().clone())
            out.square().mean().backward()
            opt.step()
            opt.zero_grad()
    rec = replayer.open(path)
    around = [s for s in rec.steps if s.module_path in ("", "rnn")]
    assert len(around) == 8, [(s.module_path, s.phase) for s in rec.steps]
    for step in around:
        res = replayer.replay(rec, step)
        assert res.match and all(d.match and d.mismatched == 0 for d in res.outputs), (step, res.outputs)
        if step.module_path == "" and step.phase == "forward":
            replayed, live = res.values["output"], outputs[step.iteration]
            assert torch.equal(replayed.view(torch.int32), live.view(torch.int32))
    lstm = next(s for s in rec.steps if s.module_path == "rnn.module" and s.phase == "forward")
    with pytest.raises(ReplayError, match="weight_hh_l0") as refused:
        replayer.replay(rec, lstm)
    assert "_flat_weight" not in str(refused.value), refused.value


def test_an_lstm_step_refused_for_a_weight_its_wrapper_sets_names_the_wrapper_step(tmp_path: Path) -> None:
    """The LSTM's own steps under WeightDrop were refused saying "register_buffer has it recorded", advice that
    does not fit a weight made anew (dropout of the raw weight) before every call. The refusal now says the
    tensor is set on the module by code outside it before each call, and names the enclosing step to replay."""
    torch.manual_seed(0)
    model = DropConnectLM()
    path = tmp_path / "run.zarr"
    with pytest.warns(recorder.RecorderWarning, match="holds weight_hh_l0"), \
            recorder.record(path, model=model, mode="full", modules=["**"]):
        model(torch.randint(0, 13, (5, 3))).square().mean().backward()
    rec = replayer.open(path)
    said = ("attribute weight_hh_l0 of the step's module is a tensor that code outside the module sets on it before "
            "each call (a wrapper or hook), so not recorded with this step; replaying the step that encloses it, "
            "step {} (WeightDrop at rnn), whose code sets it, works")
    for phase in ("forward", "backward"):
        lstm = next(s for s in rec.steps if s.module_path == "rnn.module" and s.phase == phase)
        wrapper = next(s for s in rec.steps if s.module_path == "rnn" and s.phase == phase)
        with pytest.raises(ReplayError) as refused:
            replayer.replay(rec, lstm)
        assert said.format(wrapper.index) in str(refused.value), refused.value
        assert "register_buffer" not in str(refused.value), refused.value
        assert replayer.replay(rec, wrapper).match


@contextlib.contextmanager
def float64_default() -> Iterator[None]:
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(torch.float32)


def test_a_non_contiguous_input_replays_under_another_default_device(tmp_path: Path) -> None:
    """A step whose recorded input was a transposed view is given its input with the recorded
    strides, on the recorded device, whatever the caller's default device."""
    path = tmp_path / "run.zarr"
    with recorder.record(path, mode="full"):
        project(torch.randn(8, 4).t(), torch.randn(8, 3))
    with torch.device("meta"):
        assert replayer.replay(replayer.open(path), 0).match


def test_a_step_recorded_under_a_gpu_default_device_is_refused_without_one(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Recorded under torch.set_default_device("cuda") with CPU tensors, replayed where there is no
    GPU: the step ran, raised "Torch not compiled with CUDA enabled" and was called a MISMATCH; and a
    recorded CUDA autocast region printed torch's warning that it was disabled."""
    import warnings

    from replayer.recording import Step

    path = tmp_path / "run.zarr"
    with recorder.record(path, mode="full"):
        project(torch.randn(4, 8), torch.randn(8, 3))
    rec = replayer.open(path)
    recorded = rec.step(0).settings
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(Step, "settings", property(lambda self: {**recorded, "default_device": "cuda:0"}))
    with pytest.raises(ReplayError, match=r"^the step ran with cuda:0 as the default device \(torch."
                                          r"set_default_device, or a `with torch.device\(...\)` block\), and this "
                                          r"machine has no GPU; replay it on a machine with one$"):
        replayer.replay(rec, 0)
    monkeypatch.setattr(Step, "settings", property(lambda self: {**recorded, "autocast_cuda": True,
                                                                 "autocast_cuda_dtype": "float16"}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert replayer.replay(rec, 0).match


def test_another_cpu_capability_is_reported_and_left_alone(gpt_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process cannot change the CPU capability torch dispatches to: a replay where it differs
    from the recording's says so, with the variable that sets it, and still runs."""
    rec = replayer.open(gpt_run)
    recorded = rec.step("Attention@iter=1#0").settings["cpu_capability"]
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "NOT_" + recorded)
    res = replayer.replay(rec, "Attention@iter=1#0")
    assert res.match  # the kernels are the ones this process has; here, the same
    assert [w for w in res.warnings if w.startswith("cpu_capability")] == [
        f"cpu_capability was {recorded!r} when recorded and is {'NOT_' + recorded!r} here; it cannot be changed "
        "in a running process (set ATEN_CPU_CAPABILITY before starting)"]


def test_forcing_another_thread_count_is_reported_as_a_likely_cause(gpt_run: Path, tmp_path: Path) -> None:
    """LayerNorm's parameter grads depend on the thread count: with --threads 1 the block's backward
    differs, and the report names the forced setting and the likely cause."""
    res = pdbg_here("replay", str(gpt_run), "Block@iter=0#1:backward", "--threads", "1", cwd=tmp_path)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "threads: recorded 2, replayed with 1 (forced)" in res.stdout
    assert "a likely cause of the difference" in res.stdout and "MISMATCH" in res.stdout
    same = pdbg_here("replay", str(gpt_run), "Block@iter=0#1:backward", "--threads", "2", "--json", cwd=tmp_path)
    assert same.returncode == 0 and json.loads(same.stdout)["match"] is True


def test_editing_the_source_after_recording_is_reported_as_drift(tmp_path: Path) -> None:
    """Replay still runs with the code as it is now, and says what changed; the enclosing block's
    replay shows the inner step that diverged first."""
    run = record_gpt(tmp_path, iterations=1)
    script = tmp_path / "gpt_train.py"
    text = script.read_text()
    script.write_text(text.replace("/ gamma  # EDIT-MARKER", "/ (gamma + 1e-3)  # EDIT-MARKER"))
    rec = replayer.open(run)
    res = replayer.replay(rec, "smooth_relu@iter=0#1")
    assert not res.match
    assert any(w.startswith("code of smooth_relu changed since recording") for w in res.warnings), res.warnings
    block = replayer.replay(rec, "Block@iter=0#1")
    assert not block.match and block.first_divergence is not None
    assert block.first_divergence.step.name == "smooth_relu"
    assert [s.match for s in block.inner] == [True, False]
    assert any("code of smooth_relu changed" in w for w in block.warnings)
    back = replayer.replay(rec, "Block@iter=0#1:backward")
    assert not back.match and back.first_divergence.step.name == "smooth_relu"
    assert back.first_divergence.step.phase == "backward"
    cli = pdbg_here("replay", str(run), "smooth_relu@iter=0#1", cwd=tmp_path)
    assert cli.returncode == 1 and "code of smooth_relu changed since recording" in cli.stdout


CHILD_SCRIPT = """
import sys
import torch
from torch import nn
import recorder


class SoftAct(nn.Module):
    def forward(self, x):
        return torch.log1p(torch.exp(x * 4.0))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = SoftAct()

    def forward(self, x):
        return self.act(self.fc(x))


torch.manual_seed(0)
model = nn.Sequential(Block())
with recorder.record(sys.argv[1], model=model, modules="0", mode="full"):
    model(torch.randn(2, 4))
"""


def test_a_submodule_whose_file_changed_since_recording_is_named(tmp_path: Path) -> None:
    """The code of a step's submodule (SoftAct inside the recorded Block, both in the script) edited after
    recording: the replay names SoftAct's changed code (schema 1.17 holds its hash); a recording before 1.17,
    which holds none, names the file modified after the recording began, with the classes the step's module
    uses from it, and says the submodules' code cannot be checked."""
    from tests.sealing import as_schema, rewrite_docs

    script = tmp_path / "train.py"
    script.write_text(CHILD_SCRIPT)
    assert python("train.py", "run.zarr", cwd=tmp_path).returncode == 0
    shutil.copytree(tmp_path / "run.zarr", tmp_path / "old.zarr")
    rewrite_docs(tmp_path / "old.zarr", lambda i, doc: {k: v for k, v in doc.items() if k != "submodule_code"}
                 if isinstance(doc, dict) and "submodule_code" in doc else None)
    as_schema(tmp_path / "old.zarr", "1.16")
    script.write_text(CHILD_SCRIPT.replace("x * 4.0", "x * 4.01"))
    os.utime(script, (time.time() + 5, time.time() + 5))  # (a second's clock on some file systems)
    res = pdbg_here("replay", "run.zarr", "0", "--json", cwd=tmp_path)
    doc = json.loads(res.stdout)
    assert res.returncode == 1 and not doc["match"]
    assert f"code of SoftAct (a submodule of Block: 0.act) changed since recording ({script}:8): a likely cause of " \
        "the difference" in doc["warnings"], doc["warnings"]
    assert not any("was modified after the recording began" in w for w in doc["warnings"]), doc["warnings"]
    res = pdbg_here("replay", "old.zarr", "0", "--json", cwd=tmp_path)
    doc = json.loads(res.stdout)
    assert res.returncode == 1 and not doc["match"]
    assert any(w.startswith(f"{script} was modified after the recording began, and the step's module uses Block, "
                            "SoftAct from it") for w in doc["warnings"]), doc["warnings"]
    assert "recorded with schema 1.16, before 1.17, which held no hash of the code of a module's submodule " \
        "classes: whether that of SoftAct changed since recording cannot be checked (a likely cause of the " \
        "difference if it did)" in doc["warnings"], doc["warnings"]
    assert not any("SoftAct (a submodule" in w for w in doc["warnings"]), doc["warnings"]


def test_a_submodule_class_edited_after_recording_is_named_in_replay_and_verify(tmp_path: Path) -> None:
    """Blocks recorded with record(modules=...), each holding an MLP and a Gate of the user's module file; MLP's
    forward edited afterwards, its file's time kept: replay and verify were a MISMATCH with no word of why (only
    the step's own class, Block, was hashed). Now they name MLP, where it is, and its code as the likely cause;
    Gate, unchanged, is not named, nor anything on a replay before the edit."""
    from tests.models import edit_mlp, record_submodel

    run = record_submodel(tmp_path)
    before = pdbg_here("replay", str(run), "0", "--json", cwd=tmp_path)
    assert before.returncode == 0 and json.loads(before.stdout)["warnings"] == [], before.stdout
    module = edit_mlp(tmp_path)
    res = pdbg_here("replay", str(run), "0", "--json", cwd=tmp_path)
    doc = json.loads(res.stdout)
    assert res.returncode == 1 and not doc["match"]
    assert doc["warnings"] == [f"code of MLP (a submodule of Block: blocks.0.mlp) changed since recording "
                               f"({module}:6): a likely cause of the difference"]
    back = pdbg_here("replay", str(run), "Block@iter=0#1:backward", cwd=tmp_path)
    assert back.returncode == 1 and f"warning: code of MLP (a submodule of Block: blocks.1.mlp) changed since " \
        f"recording ({module}:6): a likely cause of the difference" in back.stdout, back.stdout
    verify = pdbg_here("verify", str(run), cwd=tmp_path)
    assert verify.returncode == 1
    lines = verify.stdout.splitlines()
    assert lines[0] == f"{run}: 0 of 4 steps replayed bit for bit (0.0%)"
    steps = [line for line in lines if line.startswith("  step ")]  # (not the environment's line, where it differs)
    for line, path in zip(steps, ("blocks.0", "blocks.1", "blocks.1", "blocks.0"), strict=True):
        assert line.endswith(f"; code of MLP (a submodule of Block: {path}.mlp) changed since recording ({module}:6): "
                             "a likely cause of the difference"), line
    assert "Gate" not in verify.stdout + res.stdout


def test_a_moved_script_is_found_with_script_option(tmp_path: Path) -> None:
    run = record_gpt(tmp_path, iterations=1)
    moved = tmp_path / "elsewhere.py"
    (tmp_path / "gpt_train.py").rename(moved)
    gone = pdbg_here("replay", str(run), "Block", cwd=tmp_path)
    assert gone.returncode == 2 and "cannot read the training script" in gone.stderr and "--script" in gone.stderr
    wrong = pdbg_here("replay", str(run), "Block", "--script", str(tmp_path / "nope.py"), cwd=tmp_path)
    assert one_line_error(wrong) == (f"pdbg: error: the training script given with --script (script= in Python), "
                                     f"{tmp_path / 'nope.py'}, is not a file here; give the path the script recorded "
                                     f"as {tmp_path / 'gpt_train.py'} has now"), wrong.stderr
    found = pdbg_here("replay", str(run), "Block", "--script", str(moved), cwd=tmp_path)
    assert found.returncode == 0, found.stderr
    # edited there too: the drift warning names the file the code was loaded from, and where it was recorded
    moved.write_text(moved.read_text().replace("class Block(nn.Module):\n", "class Block(nn.Module):\n    # edited\n"))
    found = pdbg_here("replay", str(run), "Block", "--script", str(moved), cwd=tmp_path)
    assert (f"code of Block changed since recording ({moved}:80; recorded at {tmp_path / 'gpt_train.py'}:80)"
            in found.stdout), found.stdout


def one_line_error(res: object, code: int = 2) -> str:
    assert res.returncode == code, (res.stdout, res.stderr)  # type: ignore[attr-defined]
    lines = res.stderr.strip().splitlines()  # type: ignore[attr-defined]
    assert len(lines) == 1 and lines[0].startswith("pdbg: error: ") and "Traceback" not in res.stderr  # type: ignore[attr-defined]
    return lines[0]


def test_bad_command_lines_get_one_line_and_exit_code_2(gpt_run: Path, tmp_path: Path) -> None:
    """Options argparse refuses, a mistyped command, a path that does not exist (which would
    otherwise open the full-screen TUI on an error), a selector whose suffix does not parse (taken
    for a step name, it matched nothing), a setting of the wrong kind (the replay then warned and
    passed), an empty selector or condition for find (it matched every step): one line, exit 2,
    never the TUI."""
    for args, says in ((("replay", str(gpt_run), "0", "--seed", "abc"), "argument --seed: invalid int value"),
                       ((), "give a command, or a recording to open"),
                       (("info",), "the following arguments are required: RUN"),
                       (("infoo", str(gpt_run)), "unknown command 'infoo' (did you mean 'info'?)"),
                       # words for a command it has under another name: not the nearest spelling ('bisect')
                       (("list", str(gpt_run)), "unknown command 'list' (did you mean 'info'?)"),
                       (("diff", str(gpt_run), str(gpt_run)), "unknown command 'diff' (did you mean 'bisect --"),
                       (("nosuch.zarr",), "nosuch.zarr does not exist"),
                       (("--", "-dash.zarr"), "-dash.zarr does not exist"),  # a path starting with -, for the TUI
                       ((str(gpt_run),), "the TUI needs a terminal"),
                       (("replay", str(gpt_run), "Attention@iter=abc"), "invalid step selector 'Attention@iter=abc'"),
                       (("replay", str(gpt_run), "Attention#x"), "invalid step selector"),
                       (("replay", str(gpt_run), "Block:backwards"), "invalid step selector"),
                       (("replay", str(gpt_run), "0", "--set", "num_threads=abc"), "setting num_threads='abc'"),
                       (("replay", str(gpt_run), "0", "--set", "deterministic=maybe"), "give a true/false value"),
                       (("replay", str(gpt_run), "0", "--set", "num_threads=0"), "a positive integer"),
                       # empty: refused as blank ones are, not taken for "any step" ('*' is)
                       (("find", str(gpt_run), "*", "--when", ""), "but found the end in the condition ''"),
                       (("find", str(gpt_run), ""), "invalid step selector ''")):
        assert says in one_line_error(pdbg_here(*args, cwd=tmp_path)), args
    dash = tmp_path / "-dash.zarr"  # the TUI's hint for a recording whose name starts with '-': serve takes it after --
    shutil.copytree(gpt_run, dash)
    assert "pdbg serve -- -dash.zarr to open it" in one_line_error(pdbg_here("--", "-dash.zarr", cwd=tmp_path))


def test_help_of_an_unknown_command_is_refused_not_the_tuis(tmp_path: Path) -> None:
    """`pdbg export --help` printed the TUI's help and exit 0, as for a recording named export: a word that is
    neither a command nor a path, followed by --help, is an unknown command, with the one it may mean."""
    for flag in ("--help", "-h"):
        res = pdbg_here("export", flag, cwd=tmp_path)
        assert (res.returncode, res.stdout) == (2, ""), res.stdout
        assert "pdbg: error: unknown command 'export' (did you mean 'bundle'?)" in one_line_error(res), res.stderr
    (tmp_path / "export").mkdir()  # a recording by that name: its TUI's help, as before
    assert pdbg_here("export", "--help", cwd=tmp_path).stdout.startswith("usage: pdbg tui")


def test_verify_of_a_sample_refuses_a_damaged_step_table(gpt_run: Path, tmp_path: Path) -> None:
    """`pdbg verify --sample 2` reads the whole step and tensor tables first: a damaged column is
    refused in one line, exit 2, as every other command does, whichever steps the sample picks."""
    damaged = tmp_path / "damaged.zarr"
    shutil.copytree(gpt_run, damaged)
    (damaged / "rank0" / "steps" / "t_end" / "c" / "0").unlink()
    assert "chunk rank0/steps/t_end/c/0 is missing" in one_line_error(
        pdbg_here("verify", str(damaged), "--sample", "2", cwd=tmp_path))


def test_verify_reads_a_recording_made_before_steps_had_flags(tmp_path: Path) -> None:
    """Recordings of schema 1.0, 1.1 and the first 1.2 have no steps/flags column (their flags are computed
    from the tensor statistics): `pdbg verify` called every one of them damaged, exit 2, though info, replay and
    bisect read them and the pdbg that wrote them verified them. A recording of a schema that has the column
    and lacks it is still damaged."""
    from tests.sealing import as_schema

    path = tmp_path / "run.zarr"
    record_training(path, 2, poison_at(1))
    damaged = tmp_path / "damaged.zarr"
    shutil.copytree(path, damaged)
    with replayer.open(path) as rec:
        n, origin = len(rec), replayer.first_nonfinite(rec).to_json()
    assert origin["entered"] is not None
    as_schema(path, "1.2", without=("steps/flags",))
    res = pdbg_here("verify", str(path), cwd=tmp_path)
    assert res.returncode == 0 and res.stdout.startswith(f"{path}: {n} of {n} steps replayed bit for bit"), \
        (res.stdout, res.stderr)
    found = pdbg_here("bisect", str(path), "--json", cwd=tmp_path)
    assert found.returncode != 2 and json.loads(found.stdout) == origin, found.stdout + found.stderr
    as_schema(damaged, "1.5", without=("steps/flags",))
    for command in ("verify", "bisect"):
        assert "array steps/flags is missing; the recording is damaged" in one_line_error(
            pdbg_here(command, str(damaged), cwd=tmp_path))


def test_a_newer_minor_recording_that_uses_something_new_is_refused_step_by_step(tmp_path: Path) -> None:
    """A recording of a newer minor schema that uses what it added (a tag in a document, as 1.13 added
    $mapping; a tensor role, as 1.4 added collective) stopped `pdbg verify` at the first such step, exit 2, and
    called the recording damaged. Those steps are not replayable by this version, which says so and to upgrade;
    verify goes on with the others. In a recording of this version, the same is damage."""
    from tests.sealing import as_schema, rewrite_docs

    made = tmp_path / "made.zarr"
    record_training(made, 1)
    newer = f"{layout.SCHEMA_MAJOR}.{layout.parse_version(layout.SCHEMA_VERSION)[1] + 1}"
    for version in (newer, layout.SCHEMA_VERSION):
        path = tmp_path / f"{version}.zarr"
        shutil.copytree(made, path)
        rewrite_docs(path, lambda i, doc: json.loads(json.dumps(doc).replace('"$tuple"', '"$tupl2"'))
                     if '"$tuple"' in json.dumps(doc) else None)  # in the Blocks' skeletons (LayerNorm's shape)
        as_schema(path, version)
        if version != newer:
            assert one_line_error(pdbg_here("verify", str(path), cwd=tmp_path)).endswith(
                "unknown tag '$tupl2' (written by a newer PaperDebugger? upgrade paperdebugger); the recording is "
                "damaged")
        roles = zarr.open_group(path / "rank0", mode="r+")["tensors/role"]
        roles[roles.shape[0] - 1] = len(layout.ROLES)  # the last step's last record
        if version != newer:
            assert f"holds {len(layout.ROLES)} (allowed: 0..{len(layout.ROLES) - 1}); the recording is damaged" in \
                one_line_error(pdbg_here("verify", str(path), cwd=tmp_path))
            continue
        with pytest.warns(recorder.RecorderWarning):
            rec = replayer.open(path)
        blocks = rec.steps.filter(name="Block")
        last = rec.step(len(rec) - 1)
        assert last.name != "Block" and last.records[-1].role == f"unknown role {len(layout.ROLES)}"
        from replayer import notebook
        from tui import views

        assert views.step_view(last).tensors[-1].role == last.records[-1].role and notebook.step(last)
        with pytest.warns(recorder.RecorderWarning):  # (the bundle too is of the newer schema)
            bundled = replayer.bundle(rec, last, tmp_path / f"{version}.pdbg")
            assert replayer.open(bundled.path).main_step.records[-1].role == last.records[-1].role
        res = pdbg_here("verify", str(path), "--json", cwd=tmp_path)
        assert res.returncode == 0, res.stderr
        doc = json.loads(res.stdout)
        upgrade = (f": a newer PaperDebugger recorded it (schema {newer}; this one reads {layout.SCHEMA_VERSION}), "
                   "and this one cannot replay it; upgrade paperdebugger to replay it")
        assert {m["step"]["index"]: m["reason"] for m in doc["not_replayed"]} == {
            **{int(i): f"the step holds the tag '$tupl2'{upgrade}" for i in blocks.column("index")},
            last.index: f"the step holds tensor records of a role this PaperDebugger does not know (unknown role "
                        f"{len(layout.ROLES)}){upgrade}"}
        assert doc["replayed"] == doc["matched"] == len(rec) - len(blocks) - 1 and not doc["mismatches"]
        assert one_line_error(pdbg_here("replay", str(path), str(int(blocks.column("index")[0])), cwd=tmp_path)) == (
            f"pdbg: error: step {int(blocks.column('index')[0])} (Block) holds the tag '$tupl2'{upgrade}")


def test_bad_input_gets_one_line_and_exit_code_2(gpt_run: Path, tmp_path: Path) -> None:
    assert "step 999 is out of range" in one_line_error(pdbg_here("replay", str(gpt_run), "999", cwd=tmp_path))
    assert "no step matches 'nothing@iter=1'" in one_line_error(
        pdbg_here("replay", str(gpt_run), "nothing@iter=1", cwd=tmp_path))
    assert "give the STEP" in one_line_error(pdbg_here("replay", str(gpt_run), cwd=tmp_path))
    for bad in ("0", "100000"):
        assert "--threads must be an integer from 1 to 4096, not " + bad in one_line_error(
            pdbg_here("replay", str(gpt_run), "0", "--threads", bad, cwd=tmp_path))
    assert "is not a PaperDebugger recording" in one_line_error(pdbg_here("verify", str(tmp_path), cwd=tmp_path))
    rec = replayer.open(gpt_run)
    with pytest.raises(StepNotFoundError):
        replayer.replay(rec, len(rec))
    # a swap key that names nothing in the step: refused before the replay (it was a warning, and a MATCH)
    said = one_line_error(pdbg_here("replay", str(gpt_run), "Block@iter=1", "--swap", "atn=tests.models:Attention",
                               cwd=tmp_path))
    assert said.startswith("pdbg: error: swap atn: names nothing in step ") and "attn" in said, said
    with pytest.raises(InterventionError, match=r"swap nosuch: names nothing in step \d+ \(Block\)"):
        replayer.replay(rec, "Block@iter=1", swap={"nosuch": lambda original: original})


def test_code_that_cannot_be_imported_any_more(tmp_path: Path) -> None:
    """A recording whose step code lived in a module that is gone: one line naming the module."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "gone_steps.py").write_text(
        "import recorder, torch\n\n"
        "@recorder.paper_step('Eq. 3')\n"
        "def scale(x):\n    return x * 2\n")
    (tmp_path / "train.py").write_text(
        "import sys, torch\nsys.path.insert(0, sys.argv[1])\nimport gone_steps\n"
        "gone_steps.scale(torch.ones(3))\n")
    assert pdbg_here("record", "-o", "run.zarr", "--", "train.py", str(lib), cwd=tmp_path).returncode == 0
    assert pdbg_here("replay", "run.zarr", "0", cwd=tmp_path).returncode == 0  # still there: replays
    shutil.rmtree(lib)
    line = one_line_error(pdbg_here("replay", "run.zarr", "Eq. 3", cwd=tmp_path))
    # (it said to run from the directory the run was recorded in: this one, where the file is gone)
    assert f"cannot import 'gone_steps', which the recording needs (No module named 'gone_steps'); its file when " \
           f"recorded, {lib / 'gone_steps.py'}, is not on this machine: install the package, or put the directory " \
           "that holds gone_steps/ (or gone_steps.py) on PYTHONPATH" in line, line
    line = one_line_error(pdbg_here("verify", "run.zarr", cwd=tmp_path))
    assert "cannot import 'gone_steps'" in line
    with pytest.raises(ReplayError, match="cannot import 'gone_steps'"):
        replayer.replay(replayer.open(tmp_path / "run.zarr"), 0)


def test_info_summarises_the_run_and_finds_the_first_nonfinite_step(tmp_path: Path) -> None:
    path = tmp_path / "run.zarr"
    record_training(path, 2, before=poison_at(1))
    res = pdbg_here("info", str(path), "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    # alerts: the attention step that went NaN broke its attention_weights watch too (it is nonfinite)
    assert {k: doc[k] for k in ("status", "steps", "iterations", "ranks", "alerts", "schema_version")} == {
        "status": "complete", "steps": 24, "iterations": 2, "ranks": 1, "alerts": 1,
        "schema_version": layout.SCHEMA_VERSION}
    calls = {p["name"]: (p["forward_calls"], p["backward_calls"]) for p in doc["paper_steps"]}
    assert calls == {"Block": (4, 4), "Attention": (4, 4), "smooth_relu": (4, 4)}
    block = next(p for p in doc["paper_steps"] if p["name"] == "Block")
    assert block["paper"]["label"] == "Algorithm 1" and 0 < block["time_share"] <= 1
    first = doc["first_nonfinite"]
    assert (first["name"], first["module_path"], first["iteration"], first["phase"]) == ("Block", "h.1", 1, "forward")
    assert doc["bytes"] > 10_000
    text = pdbg_here("info", str(path), cwd=tmp_path).stdout
    assert "NaN origin: none of the recorded steps; it came in at step" in text and "Block" in text  # (poisoned)
    # what the alert says, not only how many there are
    assert re.search(r"\nalerts: 1 .*\n  step \d+ \(Attention, iteration 1\): watch attention_weights: ", text), text
    # The NaN step replays bit for bit, NaN positions included.
    res = replayer.replay(replayer.open(path), first["index"])
    assert res.match and res.diffs["output"].recorded["nan"] > 0


def test_replay_json_is_the_documented_object(gpt_run: Path, tmp_path: Path) -> None:
    res = pdbg_here("replay", str(gpt_run), "Eq. 2@iter=2#1", "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert {"step", "match", "outputs", "warnings", "environment_differences"} <= set(doc)
    assert doc["step"]["name"] == "smooth_relu" and doc["step"]["iteration"] == 2 and doc["step"]["call"] == 1
    (out,) = doc["outputs"]
    assert {"name", "match", "max_abs_diff", "max_rel_diff", "max_ulp", "recorded", "replayed"} <= set(out)
    assert set(out["recorded"]) == {"min", "max", "mean", "std", "nan", "inf"} and out["recorded"] == out["replayed"]
    sampled = json.loads(pdbg_here("verify", str(gpt_run), "--sample", "5", "--json", cwd=tmp_path).stdout)
    assert sampled == {"replayed": 5, "matched": 5, "mismatches": [], "not_replayed": [], "environment_differences": []}


@recorder.paper_step("Eq. 4", description="a shared layer applied twice")
class Shared(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


def test_a_module_called_twice_in_a_pass_compares_each_calls_own_parameter_grads(tmp_path: Path) -> None:
    """Each call's parameter-grad records hold its own share of the pass's total (what its graph's
    uses of the parameters sent): a replay of one call's backward computes it alone and compares it,
    with its grad input. Chained (one call feeding the other) or side by side (a Siamese encoder on
    two views whose inputs need no grad: nothing else to compare). The shares add up to .grad."""
    layer = Shared()
    with recorder.record(tmp_path / "run.zarr", model=layer) as run:
        layer(layer(torch.randn(3, 4, requires_grad=True))).sum().backward()
        run.next_iteration()
        layer.zero_grad()
        (layer(torch.randn(3, 4)) * layer(torch.randn(3, 4))).sum().backward()  # two views
        run.next_iteration()
    rec = replayer.open(tmp_path / "run.zarr")
    for selector, compared in (("Eq. 4@iter=0#0:backward", {"args.0", "lin.weight", "lin.bias"}),
                               ("Eq. 4@iter=0#1:backward", {"args.0", "lin.weight", "lin.bias"}),
                               ("Eq. 4@iter=1#0:backward", {"lin.weight", "lin.bias"}),
                               ("Eq. 4@iter=1#1:backward", {"lin.weight", "lin.bias"})):
        res = replayer.replay(rec, selector)
        assert res.match and {d.name for d in res.outputs} == compared, (selector, res.outputs)
        assert not any("total" in w for w in res.warnings), res.warnings
    shares = [rec.step(f"Eq. 4@iter=1#{call}:backward").tensor("lin.weight", "param_grad") for call in (0, 1)]
    assert torch.equal(shares[0] + shares[1], layer.lin.weight.grad)
    doc = json.loads(pdbg_here("verify", str(tmp_path / "run.zarr"), "--json", cwd=tmp_path).stdout)
    assert doc["matched"] == doc["replayed"] == 8 and not doc["not_replayed"], doc


def test_a_weight_decay_term_in_the_loss_leaves_the_steps_backward_bit_exact(tmp_path: Path) -> None:
    """Eq. 9 of many papers: loss = task + lambda * sum ||W||^2, over every parameter. The penalty's
    gradient joins each parameter's outside the steps; a step's backward records its own share,
    which a replay computes: `pdbg verify` matches every step (every backward step was a false
    MISMATCH, its parameter grads off by the penalty's 2 * lambda * W)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "run.zarr"
    with recorder.record(path, model=model, optimizer=opt, mode="full", modules=["0", "2"]):
        for _ in range(2):  # (the optimizer's steps end the iterations)
            task = model(torch.randn(4, 8)).pow(2).mean()
            (task + 1e-2 * sum(p.pow(2).sum() for p in model.parameters())).backward()
            opt.step()
            opt.zero_grad()
    done = pdbg_here("verify", str(path), "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads(done.stdout)
    assert doc["replayed"] == doc["matched"] == 8 and doc["not_replayed"] == [], doc
    rec = replayer.open(path)
    back = replayer.replay(rec, "Linear@iter=1#1:backward")  # the second Linear's ("2")
    assert {d.name for d in back.outputs} == {"args.0", "weight", "bias"} and back.match


def test_parameter_grad_totals_over_two_calls_are_compared_together(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Parameter grads recorded as the pass's totals (by recorders before schema 1.11, or where no
    use of the parameters was found in the call's graph): replaying one call's backward replays the
    other's with it, on the same module, and compares that total; the warning says so. (The first
    call's argument is a leaf, whose uses are found as the parameters' are: with none found, its
    gradient is not recorded, and the forward step's note says so.)"""
    from recorder import taps

    monkeypatch.setattr(taps, "parameter_uses", lambda *_: None)  # no use found: totals
    layer = Shared()
    with recorder.record(tmp_path / "run.zarr", model=layer) as run:
        layer(layer(torch.randn(3, 4, requires_grad=True))).sum().backward()
        run.next_iteration()
    rec = replayer.open(tmp_path / "run.zarr")
    assert any(n.startswith(f"args.0 {layout.LEAF_UNFOLLOWED_NOTE}") for n in rec.step(0).extra["notes"])
    for call in (0, 1):
        back = rec.step(f"Eq. 4@iter=0#{call}:backward")
        assert not back.extra.get("own_grads")
        res = replayer.replay(rec, back.index)
        assert res.match and {d.name for d in res.outputs} == {"args.0", "lin.weight", "lin.bias"} - (
            {"args.0"} if call == 0 else set()), res.outputs
        assert any("compared as the total over the 2 calls of" in w for w in res.warnings), res.warnings


@recorder.paper_step("Eq. 8", description="an orthogonal recurrence")
class OrthoCell(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rot = torch.nn.utils.parametrizations.orthogonal(torch.nn.Linear(4, 4, bias=False))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.rot(h))


@pytest.mark.parametrize(("calls", "made"), [(2, "by the first call"), (3, "by the first call"), (2, "before")])
def test_a_weight_made_once_for_several_calls_is_not_compared_as_one_calls(tmp_path: Path, calls: int,
                                                                          made: str) -> None:
    """Under parametrize.cached() the first call (or the code before the calls) makes the orthogonal
    weight and the later calls use it too: the gradient reaching the parametrization's parameter is
    every call's. It is not taken for the first call's own (a false MISMATCH of 28 elements with
    three calls, and with two the calls were replayed together, each computing the weight anew: a
    MISMATCH too); it is left out, saying why, and the grad inputs are compared."""
    torch.manual_seed(0)
    cell = OrthoCell()
    with recorder.record(tmp_path / "run.zarr", model=cell, mode="full"):
        h = torch.randn(2, 4, requires_grad=True)
        with torch.nn.utils.parametrize.cached():
            if made == "before":
                assert cell.rot.weight.requires_grad
            for _ in range(calls):
                h = cell(h)
        h.sum().backward()
    rec = replayer.open(tmp_path / "run.zarr")
    for call in range(calls):
        res = replayer.replay(rec, f"Eq. 8#{call}:backward")
        assert res.match and {d.name for d in res.outputs} == {"args.0"}, (call, res.outputs, res.warnings)
        assert any(w.startswith("parameter grads not compared: rot.parametrizations.weight.original")
                   for w in res.warnings), res.warnings
    done = pdbg_here("verify", str(tmp_path / "run.zarr"), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_call_under_no_grad_does_not_count_toward_parameter_grad_totals(tmp_path: Path) -> None:
    """Train, then evaluate under no_grad, in every iteration: the evaluation's call has no backward,
    so the training call's parameter grads are its own and are compared (they were left out as a
    total over both calls, and `pdbg verify` failed the step)."""
    layer = Shared()
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    with recorder.record(tmp_path / "run.zarr", model=layer, optimizer=opt):
        for _ in range(2):
            layer(torch.randn(3, 4)).square().sum().backward()
            with torch.no_grad():
                layer(torch.randn(3, 4))
            opt.step()
            opt.zero_grad()
    rec = replayer.open(tmp_path / "run.zarr")
    res = replayer.replay(rec, "Eq. 4@iter=1#0:backward")
    assert res.match and sorted(d.name for d in res.outputs) == ["lin.bias", "lin.weight"]
    assert not any("times in this backward pass" in w for w in res.warnings), res.warnings
    done = pdbg_here("verify", str(tmp_path / "run.zarr"), "--json", cwd=tmp_path)
    assert done.returncode == 0 and json.loads(done.stdout)["mismatches"] == [], done.stdout


def test_micro_batches_and_closures_are_passes_of_their_own(tmp_path: Path) -> None:
    """Gradient accumulation over two micro-batches, and LBFGS calling its closure several times:
    each backward pass records its own parameter grads, so they are compared (they were left out
    as "a total over" every call of the iteration)."""
    layer = Shared()
    path = tmp_path / "run.zarr"
    with recorder.record(path, model=layer, mode="full") as run:
        for _ in range(2):  # two micro-batches, one iteration
            layer(torch.randn(3, 4)).square().sum().backward()
        run.next_iteration()
        lbfgs = torch.optim.LBFGS(layer.parameters(), max_iter=3)

        def closure() -> torch.Tensor:
            lbfgs.zero_grad()
            loss = layer(torch.randn(3, 4, generator=torch.Generator().manual_seed(0))).square().sum()
            loss.backward()
            return loss

        lbfgs.step(closure)
    rec = replayer.open(path)
    backward = [s for s in rec.steps if s.phase == "backward"]
    assert len(backward) >= 4
    for step in backward:
        result = replayer.replay(rec, step.index)
        assert result.match and {"lin.weight", "lin.bias"} <= set(result.diffs), (step.selector, result.warnings)


def test_every_kind_of_step_replays(tmp_path: Path) -> None:
    """A module recorded by a --modules glob with a keyword tensor and a non-persistent buffer, an
    annotate()d library module, a function with keyword tensors and a tuple output holding an int,
    a non-contiguous input, bfloat16, and a step that raised: each replays and matches."""
    from tests.replayer import kinds

    net = kinds.Net()
    recorder.annotate(net.norm, "Eq. 8")
    with recorder.record(tmp_path / "run.zarr", model=net, modules=["kw"]):
        x = torch.randn(5, 4, requires_grad=True)
        transposed = x.t().contiguous().t()
        a, _, g = kinds.split_scale(transposed, scale=torch.full((2,), 3.0), k=2)
        (net(x).sum() + a.sum() + g.sum()).backward()
        kinds.split_scale(torch.randn(3, 4).to(torch.bfloat16), scale=torch.ones(2, dtype=torch.bfloat16))
        with pytest.raises(ValueError):
            kinds.checked(torch.tensor([-1.0]))
    rec = replayer.open(tmp_path / "run.zarr")
    assert rec.step("Eq. 5#0").tensors("input")[0].stride == (1, 5)  # column-major, as it was given
    seen = set()
    for step in rec.steps:
        res = replayer.replay(rec, step)
        assert res.match and res.outputs, (step, [d.summary() for d in res.outputs])
        seen.add((step.name, step.phase))
    assert seen == {("Keyworded", "forward"), ("Keyworded", "backward"), ("LayerNorm", "forward"),
                    ("LayerNorm", "backward"), ("split_scale", "forward"), ("split_scale", "backward"),
                    ("checked", "forward")}
    raised = replayer.replay(rec, "checked")
    assert raised.exception == "ValueError: negative input"
    kw = replayer.replay(rec, "kw")
    assert {d.name for d in kw.outputs} == {"output"} and kw.rebuilt["kw"] == "skeleton"


def test_lazy_conjugates_replay_and_match_by_value(tmp_path: Path) -> None:
    """A complex step given a conjugate view and returning ``conj()`` and ``conj().imag`` (views whose
    memory does not hold their values): recorded by value, replayed, and compared bitwise."""
    from tests.replayer import kinds

    z = torch.complex(torch.randn(2, 3), torch.randn(2, 3))
    w = torch.complex(torch.randn(2, 3), torch.randn(2, 3))
    with recorder.record(tmp_path / "run.zarr", mode="full"):
        conj, imag = kinds.spectral(z, w.conj())
    rec = replayer.open(tmp_path / "run.zarr")
    step = rec.step("Eq. 7")
    assert bits_equal(step.tensor("args.1"), w.conj().resolve_conj())
    assert bits_equal(step.tensor("output.0"), conj.resolve_conj())
    assert bits_equal(step.tensor("output.1"), imag.resolve_neg())
    res = replayer.replay(rec, step)
    assert res.match and {d.name for d in res.outputs} == {"output.0", "output.1"}, [d.summary() for d in res.outputs]


def test_a_step_without_payloads_says_why_it_cannot_be_replayed(tmp_path: Path) -> None:
    """The error names the reason the step's note gives (a sparse tensor whose parts were not kept: why,
    and what to do instead), or, without a note, the ways a recording keeps statistics only; the CLI
    prints it on one line. (A sparse tensor recorded with its parts replays: test_sparse.py.)"""
    from tests.replayer import kinds

    with recorder.record(tmp_path / "sparse.zarr", mode="stats"):
        kinds.spectral(torch.eye(2, dtype=torch.complex64).to_sparse(), torch.ones(2, 2, dtype=torch.complex64))
    with pytest.raises(ReplayError, match=r"its input args\.0 is a sparse_coo tensor, of which the recording kept "
                                          r"statistics of its stored values only, not its indices and values \(the run "
                                          r"was recorded in stats mode, which keeps statistics only\); record the step "
                                          r"with payloads \(mode full, or a flight dump\) to replay it"):
        replayer.replay(tmp_path / "sparse.zarr", "Eq. 7")
    why = r"\(torch\.sparse_coo tensor on cpu: metadata only; statistics of its 2 stored values"
    with pytest.raises(FormatError, match=r"statistics only " + why):
        replayer.open(tmp_path / "sparse.zarr").step("Eq. 7").tensor("args.0")
    with recorder.record(tmp_path / "stats.zarr", mode="stats"):
        kinds.spectral(torch.ones(2, dtype=torch.complex64), torch.ones(2, dtype=torch.complex64))
    error = one_line_error(pdbg_here("replay", str(tmp_path / "stats.zarr"), "Eq. 7", cwd=tmp_path))
    assert "kept statistics only for input args.0 (the run was recorded in stats mode, which keeps statistics only" \
        in error
    # A backward step's refusal names the forward call it runs again, and why that one (it named step N alone)
    from tests.replayer import nanmodels

    with recorder.record(tmp_path / "grad.zarr", mode="stats"):
        nanmodels.smooth_relu(torch.ones(3, requires_grad=True) * 2).sum().backward()
    grad = replayer.open(tmp_path / "grad.zarr")
    (back,) = [s for s in grad.steps if s.phase == "backward"]
    error = one_line_error(pdbg_here("replay", str(tmp_path / "grad.zarr"), str(back.index), cwd=tmp_path))
    assert error.startswith(f"pdbg: error: backward step {back.index} (smooth_relu) runs its forward call, step "
                            f"{back.forward}, again, which kept statistics only for input args.0"), error


def test_a_step_drawing_from_a_generator_it_is_given_replays(tmp_path: Path) -> None:
    """A torch.Generator argument is recorded with its state before the call: the replay draws the
    same numbers from a generator in that state, and the caller's generator is not touched."""
    from tests.replayer import kinds

    generator = torch.Generator().manual_seed(7)
    torch.randn(3, generator=generator)  # a state other than the seed's
    twin = torch.Generator()
    twin.set_state(generator.get_state())
    with recorder.record(tmp_path / "run.zarr", mode="full"):
        first = kinds.noised(torch.zeros(4), generator, sigma=0.5)
        kinds.noised(torch.zeros(4), generator=generator)
    assert bits_equal(first, 0.5 * torch.randn(4, generator=twin))  # recording drew as the call did
    rec = replayer.open(tmp_path / "run.zarr")
    assert rec.step(0).arguments["args"][1]["$generator"]["device"] == "cpu"
    after = generator.get_state()
    for index in (0, 1):
        assert replayer.replay(rec, index).match
    assert torch.equal(generator.get_state(), after)



@recorder.paper_step("Eq. 12", description="a reduction, whose last bits follow its input's layout")
def total(x: torch.Tensor) -> torch.Tensor:
    return x.sum() * 1.5


LAYOUTS = {
    "rows with gaps": lambda big: big[::2],
    "columns with gaps": lambda big: big[:, ::2],
    "a chunk": lambda big: big.chunk(2, -1)[0],
    "overlapping windows": lambda big: big.unfold(0, 4, 2),
    "expanded": lambda big: (big[0] * 1.5).expand(64, 64),
    "transposed": lambda big: big.t(),
}


@pytest.mark.parametrize("requires_grad", [False, True], ids=["no grad", "requires grad"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_an_input_replays_in_its_recorded_layout(tmp_path: Path, layout: str, requires_grad: bool) -> None:
    """An input with gaps (a slice with a step, a chunk), overlapping windows, an expanded one or a
    transposed one is given to the replay in its recorded layout, with and without grad: a sum's
    bits follow the layout, so forward and backward replay bit for bit."""
    path = tmp_path / "run.zarr"
    torch.manual_seed(0)
    with recorder.record(path, mode="full"):
        for _ in range(3):
            big = torch.randn(64, 64, requires_grad=requires_grad)
            x = LAYOUTS[layout](big)
            total(x).backward() if requires_grad else total(x)
    rec = replayer.open(path)
    assert len(rec.steps) == (6 if requires_grad else 3)
    for step in rec.steps:
        if step.phase == "forward":
            assert step.tensors("input")[0].stride == LAYOUTS[layout](torch.empty(64, 64)).stride()
        result = replayer.replay(rec, step.index)
        assert result.match and result.outputs, (step.selector, [d.summary() for d in result.outputs])


def test_a_sparse_view_of_a_large_tensor_is_said_to_replay_contiguous(tmp_path: Path) -> None:
    """h[:, ::16] of a 68 MB tensor: its layout is not made again whole for a replay (64 MiB and 8 times
    its values at most), which then gave it contiguous and reported a mismatch without a word of why:
    the warning names the input whose layout was not rebuilt, and why."""
    path = tmp_path / "run.zarr"
    torch.manual_seed(0)
    big = torch.randn(1, 17 << 20)
    with recorder.record(path, mode="full"):
        total(big[:, ::16])
    del big
    result = replayer.replay(path, 0)
    (note,) = [w for w in result.warnings if "layout" in w]
    assert note.startswith("input args.0: its recorded layout (strides [17825792, 16], a view spanning 68 MiB for "
                           "4.2 MiB of values) was not rebuilt (a view spanning more than 64 MiB and 8 times its "
                           "values is not)"), note


@recorder.paper_step("Eq. 12e", description="input projection of one time step")
def time_step_projection(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, w, b)


def unroll(kind: str) -> None:
    """Four time steps of a (T, B, F) batch (3 x 6 float32 rows, 72 bytes: xs[t] begins t * 72 bytes
    in) through an nn.LSTMCell, or of a (B, T, F) one (xs[:, t], t * 24 bytes in) through a projection
    that takes gradients of the batch too; then backward through them all."""
    torch.manual_seed(0)
    if kind == "LSTMCell on xs[t]":
        cell, xs = nn.LSTMCell(6, 10), torch.randn(4, 3, 6)
        h = c = torch.zeros(3, 10)
        outs = []
        for t in range(4):
            h, c = cell(xs[t], (h, c))
            outs.append(h)
    else:
        xs, w, b = torch.randn(3, 4, 6, requires_grad=True), torch.randn(40, 6, requires_grad=True), torch.randn(40)
        outs = [time_step_projection(xs[:, t], w, b) for t in range(4)]
    torch.stack(outs).square().sum().backward()


@pytest.mark.parametrize("kind", ["LSTMCell on xs[t]", "linear on xs[:, t]"])
def test_a_view_at_a_misaligned_address_replays_where_it_lay(tmp_path: Path, kind: str) -> None:
    """A step given xs[t] of a time-major batch (an LSTMCell unrolled over time): CPU kernels pick
    their code by the address, and F.linear(xs[1], w, b) rounds otherwise than on the same values in
    fresh memory, which a replay gave: every other call replayed as a mismatch, forward and backward,
    with no warning. The recording names where each misaligned argument and grad output lay (only
    those), and every call's forward and backward replays bit for bit."""
    path = tmp_path / "run.zarr"
    with recorder.record(path, mode="full", modules="**" if kind.startswith("LSTMCell") else None):
        unroll(kind)
    rec = replayer.open(path)
    forwards = [s for s in rec.steps if s.phase == "forward"]
    assert len(forwards) == 4 and len(rec.steps) == 8
    for step in rec.steps:
        result = replayer.replay(rec, step.index)
        assert result.match and result.outputs and not result.warnings, \
            (step.selector, result.warnings, [d.summary() for d in result.outputs])
    rows = 72 if kind.startswith("LSTMCell") else 24
    assert [s.extra.get("misaligned") for s in forwards] == \
        [None] + [{"args.0": t * rows % layout.ALIGNMENT} for t in (1, 2, 3)], [s.extra for s in forwards]


def test_a_tensor_between_two_of_its_elements_addresses_is_said_to_replay_aligned(tmp_path: Path) -> None:
    """A float32 tensor made over bytes at an odd address (torch.frombuffer at offset 1) cannot be made
    again there: the replay warns that it is given aligned memory, and why that may differ."""
    data = bytearray(np.arange(20, dtype=np.float32).tobytes() + bytes(4))
    x = torch.frombuffer(data, dtype=torch.float32, offset=1, count=16)
    at = x.data_ptr() % layout.ALIGNMENT
    path = tmp_path / "run.zarr"
    with recorder.record(path, mode="full"):
        total(x)
    assert replayer.open(path).step(0).extra["misaligned"] == {"args.0": at}
    result = replayer.replay(path, 0)
    assert f"input args.0 began {at} bytes past a 64-byte boundary when recorded (a view), not a multiple of its " \
        "4-byte elements, which a replay cannot make again: it is given aligned memory" in " ".join(result.warnings)


@recorder.paper_step("Eq. 12a", description="column sums of a numpy feature matrix")
def np_colsum(feats_t: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(feats_t.sum(axis=0))


@recorder.paper_step("Eq. 12b", description="numpy -> torch without a copy")
def np_to_tensor(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a) * 1.0


def test_a_numpy_argument_replays_in_its_recorded_layout(tmp_path: Path) -> None:
    """A transposed numpy array (numpy sums it in another order than a C-contiguous copy: 35 of 64
    sums differed by up to 128 ULP) and a reversed one (torch.from_numpy refuses negative strides: the
    recorded ValueError, which a copy did not raise) are given to the replay in their recorded
    layout: both replay as they ran."""
    path = tmp_path / "run.zarr"
    rng = np.random.default_rng(0)
    with recorder.record(path, mode="full"):
        for _ in range(3):
            feats = rng.standard_normal((40, 64)).astype(np.float32)
            np_colsum(feats.T)
            base = rng.standard_normal(8).astype(np.float32)
            with contextlib.suppress(ValueError):
                np_to_tensor(base[::-1])
    rec = replayer.open(path)
    step = rec.step("Eq. 12a@iter=0")
    seen = []
    spy = lambda fn: lambda a: (seen.append(a.strides), fn(a))[1]  # noqa: E731
    result = replayer.replay(rec, step.index, swap={"np_colsum": spy})
    assert result.match and bits_equal(result.values["output"], step.tensor("output")), \
        [d.summary() for d in result.outputs]
    assert seen == [(4, 256)]
    step = rec.step("Eq. 12b@iter=0")
    assert step.status == "exception"
    result = replayer.replay(rec, step.index)
    assert result.match, (result.warnings, [d.summary() for d in result.outputs])
    assert rec.step("Eq. 12a@iter=0").arguments["args"][0]["$ndarray"]["strides"] == [4, 256]


@recorder.paper_step("Eq. 12c", description="a numpy batch, drawn from a numpy generator passed in")
def np_jitter(images: np.ndarray, rng: Any = None) -> torch.Tensor:
    return torch.from_numpy(images + (0 if rng is None else rng.standard_normal(images.shape, dtype=np.float32)))


def test_a_step_given_a_large_numpy_array_says_why_it_cannot_be_replayed(tmp_path: Path) -> None:
    """A numpy array over the 4,096 values recorded as data was refused as a value that "could not be
    recorded as data", which it is: the refusal says why (its size against the limit, with what to do)
    instead. A numpy generator passed as an argument is recorded in its state (1.23): its call replays."""
    path = tmp_path / "run.zarr"
    with recorder.record(path, mode="full"):
        np_jitter(np.zeros((4, 3, 32, 32), dtype=np.float32))
        np_jitter(np.zeros(3, dtype=np.float32), np.random.default_rng(0))
    rec = replayer.open(path)
    with pytest.raises(ReplayError, match=r"^step 0 \(np_jitter\) was called with a numpy array of 12,288 values "
                       r"\(float32, shape \[4, 3, 32, 32\]\), over the 4,096 recorded as data \(pass it as a tensor, "
                       r"torch\.from_numpy\(a\), to have it recorded\); it cannot be replayed$"):
        replayer.replay(rec, 0)
    result = replayer.replay(rec, 1)
    assert result.match and bits_equal(result.values["output"], rec.step(1).tensor("output"))
    assert known_refusal(rec.step(0)).startswith("step 0 (np_jitter) was called with a numpy array of 12,288")


@recorder.paper_step("Eq. 13", description="h_t = tanh(W [x_t; h_{t-1}])")
class Cell(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(torch.cat([x, h], -1)))


def test_a_recurrent_cell_called_three_times_compares_each_calls_parameter_grads(tmp_path: Path) -> None:
    """A recurrent cell called three times an iteration from a state that needs no grad: every
    call's backward records its own parameter grads, so even the first call's backward, which has
    no grad input, replays and matches (its grads were a total over the three calls, which no replay
    could compare: `pdbg verify` listed it apart)."""
    torch.manual_seed(0)
    cell = Cell()
    opt = torch.optim.SGD(cell.parameters(), lr=0.1)
    path = tmp_path / "run.zarr"
    with recorder.record(path, model=cell, optimizer=opt, mode="full"):
        for _ in range(2):
            h = torch.zeros(2, 4)
            for _ in range(3):
                h = cell(torch.randn(2, 4), h)
            h.pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
    res = pdbg_here("verify", str(path), "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert doc["replayed"] == doc["matched"] == 12 and doc["mismatches"] == [] and doc["not_replayed"] == []
    first = replayer.replay(replayer.open(path), "Eq. 13@iter=1#0:backward")
    assert first.match and {d.name for d in first.outputs} == {"lin.weight", "lin.bias"}


def record_local_steps(path: Path, iterations: int, before: Any = None) -> None:
    """A step whose code is defined inside a function (no replay can import it), called once an
    iteration, after ``before`` if given."""
    @recorder.paper_step("Eq. 14")
    def local_step(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    with recorder.record(path, mode="full") as run:
        for _ in range(iterations):
            x = torch.randn(3)
            local_step(before(x) if before is not None else x)
            run.next_iteration()


def test_verify_tells_steps_it_cannot_replay_from_differences(tmp_path: Path) -> None:
    """A step whose code was defined inside a function cannot be replayed: `pdbg verify` lists it
    apart, with why, and exits 0 when every step it could replay matched."""
    path = tmp_path / "run.zarr"
    record_local_steps(path, 2, before=hashed)
    res = pdbg_here("verify", str(path), "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert doc["replayed"] == doc["matched"] == 2 and doc["mismatches"] == []
    assert [m["step"]["name"].rsplit(".", 1)[-1] for m in doc["not_replayed"]] == ["local_step"] * 2
    assert all("<locals>" in m["reason"] for m in doc["not_replayed"]), doc["not_replayed"]
    text = pdbg_here("verify", str(path), cwd=tmp_path)
    assert text.returncode == 0 and text.stdout.splitlines()[0].endswith(
        "run.zarr: 2 of 2 steps replayed bit for bit (100.0%); 2 steps could not be replayed")
    assert text.stdout.splitlines()[1] == "could not be replayed:"


def test_verify_lists_a_step_whose_tensors_are_corrupted_and_verifies_the_others(tmp_path: Path) -> None:
    """A payload whose bytes are not those recorded (its checksum fails): `pdbg verify` stopped at it
    with one error line and checked nothing else. Now it lists that step as corrupted, with which
    payload, replays the others, and exits 2 after the listing (in the JSON: ``corrupted``)."""
    path = tmp_path / "run.zarr"
    with recorder.record(path, mode="full") as run:
        for _ in range(3):
            total(torch.randn(8, 8))
            run.next_iteration()
    rank = replayer.open(path).rank
    (args,) = [r for r in rank.tensor_records(1) if r.name == "args.0"]
    hashes = zarr.open_group(path, mode="r+")[layout.rank_group(0)]["payloads/hash"]
    hashes[args.payload] = hashes[args.payload] ^ np.array([0, 1], dtype=hashes.dtype)  # another checksum
    res = pdbg_here("verify", str(path), cwd=tmp_path)
    lines = res.stdout.splitlines()
    assert res.returncode == 2, res.stdout + res.stderr
    assert lines[0] == f"{path}: 2 of 2 steps replayed bit for bit (100.0%); 1 step corrupted"
    assert lines[1] == "corrupted (a tensor's bytes read are not the bytes recorded):"
    assert lines[2].startswith("  step 1: Eq. 12 (total), forward, iteration 1, call 0: payload "
                               f"{args.payload} (tensor 'args.0' of step 1), rank0/blobs/") and \
        lines[2].endswith(": payload checksum mismatch")
    assert res.stderr == (f"pdbg: error: {path}: the recorded tensors of 1 step are corrupted (payload checksum "
                          "mismatch, listed above): restore the recording from a copy or record again\n")
    res = pdbg_here("verify", str(path), "--json", cwd=tmp_path)
    doc = json.loads(res.stdout)
    assert res.returncode == 2 and doc["replayed"] == doc["matched"] == 2 and doc["mismatches"] == []
    assert [(m["step"]["index"], m["reason"].endswith("payload checksum mismatch")) for m in doc["corrupted"]] == [
        (1, True)]


SETTING_SCRIPT = '''
import sys
import torch
import recorder

torch.set_num_threads(1)  # top-level settings, as training scripts have them
torch.manual_seed(5)
torch.use_deterministic_algorithms(True)
torch.set_default_dtype(torch.float64)


@recorder.paper_step("Eq. 1")
def scaled(x):
    return x * 2.0


if __name__ == "__main__":
    with recorder.record(sys.argv[1], mode="full"):
        scaled(torch.randn(4))
'''


def test_loading_a_training_script_leaves_the_callers_settings(tmp_path: Path) -> None:
    """Replaying a step defined in a training script loads its top level, which sets threads, a
    seed, deterministic algorithms and the default dtype: the caller's come back after."""
    (tmp_path / "train.py").write_text(SETTING_SCRIPT)
    made = python("train.py", str(tmp_path / "run.zarr"), cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    torch.set_num_threads(2)
    torch.manual_seed(11)
    expected = torch.rand(3)
    torch.manual_seed(11)
    try:
        assert replayer.replay(replayer.open(tmp_path / "run.zarr"), 0).match
        assert torch.get_num_threads() == 2 and torch.get_default_dtype() == dtype
        assert not torch.are_deterministic_algorithms_enabled()
        assert torch.equal(torch.rand(3), expected)
    finally:
        torch.set_num_threads(threads)


def test_verify_of_a_run_without_a_replayable_step_says_why(tmp_path: Path) -> None:
    """`pdbg verify` on a run with no step, or a stats-mode run: one line naming which, exit 2; the
    stats-mode run's count of steps with statistics only is printed first (in the JSON with --json)."""
    empty, stats_only = tmp_path / "empty.zarr", tmp_path / "stats.zarr"
    with recorder.record(empty, mode="full"):
        pass
    with recorder.record(stats_only, mode="stats"):
        total(torch.randn(8, 8))
    for path, said in ((empty, f"{empty} holds no step (complete); there is nothing to replay"),
                       (stats_only, f"{stats_only} kept the tensors of no step (statistics only: mode='stats'")):
        res = pdbg_here("verify", str(path), cwd=tmp_path)
        assert res.returncode == 2 and res.stderr.startswith(f"pdbg: error: {said}"), res.stderr
        assert res.stderr.count("\n") == 1
    res = pdbg_here("verify", str(stats_only), "--json", cwd=tmp_path)
    assert res.returncode == 2 and json.loads(res.stdout) == {"replayed": 0, "matched": 0, "mismatches": [],
                                                              "not_replayed": [], "statistics_only": 1,
                                                              "environment_differences": []}


@recorder.paper_step("Alg. 1 line 3", description="t ~ Uniform({0..999})")
def sample_timesteps(batch: int) -> torch.Tensor:
    return torch.randint(0, 1000, (batch,))


def test_verify_says_why_steps_that_take_no_tensor_matched_by_statistics(tmp_path: Path) -> None:
    """In stats mode, a step that takes no tensor (t ~ U drawn for an int batch size) replays, and its output,
    recorded as statistics alone, is compared by them. verify explained that as "a result recorded without
    payload, a sparse tensor whose indices were not kept": there is no sparse tensor. It says what applies."""
    path = tmp_path / "stats.zarr"
    torch.manual_seed(0)
    net = nn.Linear(1, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    with recorder.record(path, model=net, optimizer=opt, mode="stats"):
        for _ in range(3):
            net(sample_timesteps(8).float().unsqueeze(-1)).sum().backward()
            opt.step()
            opt.zero_grad()
    res = pdbg_here("verify", str(path), cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout == (f"{path}: 3 of 3 steps replayed and matched (100.0%), 3 of them by statistics only, not bit "
                          "for bit: results recorded as statistics alone (stats mode, or flight mode outside the "
                          "iterations it kept), of steps that take no tensor and so replay there\n"), res.stdout
    assert "sparse" not in res.stdout


def test_a_function_given_as_a_swap_in_python_is_told_to_be_a_factory() -> None:
    """swap={"softplus": stable_softplus} in Python calls stable_softplus(original) to make the
    replacement (an import reference names the function itself): when that raises, the message says
    so, and how to give the function itself."""
    from replayer import intervene

    def stable_softplus(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.softplus(x)

    with pytest.raises(InterventionError) as info:
        intervene.swap_function(torch.tanh, intervene.Swap("softplus", stable_softplus, None))
    said = str(info.value)
    assert said.startswith("swap softplus: a callable given in Python is a factory, called with the original "
                           "function to make the replacement, and ")
    assert said.endswith("to swap in a function itself, give lambda original: stable_softplus, or its import "
                         "reference ('module:function')") and "\n" not in said


@recorder.paper_step("Eq. 14", description="a log of the norm: returns nothing, changes no tensor")
def log_norm(x: torch.Tensor, sink: dict[str, float]) -> None:
    sink["norm"] = float(x.norm())


def test_a_step_that_returns_no_tensor_is_not_called_a_match(tmp_path: Path) -> None:
    """A step that returns None and changes no tensor gives a replay with nothing to compare:
    it is not reported as a bitwise match: ``match`` is False, `pdbg replay` says NOTHING COMPARED
    and exits 1 (a script testing the exit code or ``match`` must not take it for a bitwise match),
    `pdbg verify` lists it among the steps it could not check and, with nothing verified, exits 2
    after its listing."""
    path = tmp_path / "run.zarr"
    with recorder.record(path, mode="full"):
        for _ in range(2):
            log_norm(torch.randn(4), {})
    result = replayer.replay(replayer.open(path), 0)
    assert not result.match and not result.compared and "nothing compared" in repr(result)
    assert result.warnings[0].startswith("the step returned no tensor and changed none of its inputs, parameters or "
                                         "buffers in place, which is what a replay compares")
    res = pdbg_here("replay", str(path), "0", cwd=tmp_path)
    assert res.returncode == 1 and res.stdout.rstrip().endswith("NOTHING COMPARED: the step returned no tensor")
    assert "MATCH" not in res.stdout.replace("NOTHING COMPARED", "")
    doc = json.loads(pdbg_here("replay", str(path), "0", "--json", cwd=tmp_path).stdout)
    assert doc["match"] is False and doc["compared"] is False
    res = pdbg_here("verify", str(path), "--json", cwd=tmp_path)
    doc = json.loads(res.stdout)
    assert doc["replayed"] == doc["matched"] == 0 and len(doc["not_replayed"]) == 2
    assert res.returncode == 2 and res.stderr == ("pdbg: error: none of the 2 steps that kept their tensors could be "
                                                  f"replayed, so nothing was verified: {NOTHING_COMPARED}\n")


@recorder.paper_step("Eq. 17", description="an EMA teacher update, in place: returns nothing")
def ema_update(teacher: torch.Tensor, student: torch.Tensor) -> None:
    teacher.mul_(0.9).add_(student, alpha=0.1)


@recorder.paper_step("Algorithm 1, step 7", description="normalised gradient step, in place")
def normalised_step(params: list[nn.Parameter], lr: float) -> None:
    with torch.no_grad():
        for p in params:
            p.sub_(lr * p.grad / p.grad.norm())  # 0/0 when a gradient is all zero


def test_a_step_that_updates_its_inputs_in_place_is_compared_and_can_be_the_origin(tmp_path: Path) -> None:
    """Paper steps that work in place and return nothing (an EMA teacher update; an optimizer's
    update of the parameters it is given, reading their .grad): the inputs they change are
    recorded again as the call leaves them (after:args.0), and each parameter's .grad when the call
    began (args.0.0:grad). A replay compares them (it was NOTHING COMPARED, and an update step that
    reads .grad could not run: its parameters had none), an edit that changes the update is a
    MISMATCH, and a NaN the update writes makes it the origin (it was "entered" at the next step
    that read the parameter). Training is the same as without recording."""
    def train(path: Path | None) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(0)
        w = nn.Parameter(torch.randn(4))
        teacher = torch.zeros(4)
        with recorder.record(path, mode="full") if path else contextlib.nullcontext() as run:
            for i in range(3):
                ema_update(teacher, w.detach())
                (w * (0.0 if i == 2 else 1.0)).square().sum().backward()  # an all-zero gradient at i == 2
                normalised_step([w], 0.1)
                w.grad = None
                if run is not None:
                    run.next_iteration()
        return w.detach().clone(), teacher

    recorded = train(tmp_path / "run.zarr")
    assert all(torch.equal(a, b) or (a.isnan().all() and b.isnan().all()) for a, b in zip(recorded, train(None)))
    rec = replayer.open(tmp_path / "run.zarr")
    steps = list(rec.steps)
    assert [s.name for s in steps] == ["ema_update", "normalised_step"] * 3
    update = steps[1]
    assert {(r.role, r.name) for r in update.records} == {("input", "args.0.0"), ("input", "args.0.0:grad"),
                                                          ("output", "after:args.0.0")}
    for step in steps:
        result = replayer.replay(rec, step.index)
        assert result.match and result.compared, (step.index, [d.summary() for d in result.outputs])
    ema = replayer.replay(rec, 0)
    assert [d.name for d in ema.outputs] == ["after:args.0"]
    edited = replayer.replay(rec, update.index, edit={"args.0.0:grad": "x + 1"})
    assert not edited.match and not edited.diffs["after:args.0.0"].match
    origin = replayer.first_nonfinite(rec)
    assert origin.step is not None and origin.step.index == steps[5].index
    assert origin.cause.endswith("produced output after:args.0.0 (4 NaN of 4) from finite inputs")


@recorder.paper_step("Eq. 3", description="a scale of the activation, in place, returning nothing")
def scale_in_place(h: torch.Tensor, s: float) -> None:
    h.mul_(s)


def test_a_step_that_changes_an_activation_in_place_is_compared_and_can_be_the_origin(tmp_path: Path) -> None:
    """A step given a tensor autograd computed (a layer's output) that changes it in place and returns
    nothing: the change went unrecorded (only inputs outside autograd's graph were looked at), so its replay
    was NOTHING COMPARED, saying the step changed none of its inputs, and an Inf it wrote was found by no
    bisect ("no non-finite values recorded"). The argument is now recorded as the call left it
    (after:args.0), replayed bit for bit, and the step that overflowed is the origin."""
    def train(path: Path | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        lin = nn.Linear(8, 2)
        opt = torch.optim.SGD(lin.parameters(), lr=0.1)
        losses = []
        with recorder.record(path, model=lin, optimizer=opt) if path else contextlib.nullcontext():
            for i in range(2):
                h = lin(torch.randn(5, 8))
                scale_in_place(h, 1e39 if i == 1 else 0.5)  # float32 overflows to Inf at i == 1
                loss = h.pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.detach())
        return [*losses, *(p.detach() for p in lin.parameters())]

    path = tmp_path / "run.zarr"
    recorded, plain = train(path), train(None)
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(recorded, plain, strict=True))
    rec = replayer.open(path)
    first, second = rec.steps.filter(name="scale_in_place", phase="forward")
    assert ("output", "after:args.0") in {(r.role, r.name) for r in first.records}
    result = replayer.replay(rec, first.index)
    assert result.match and result.compared and [d.name for d in result.outputs] == ["after:args.0"]
    origin = replayer.first_nonfinite(rec)
    assert origin.step is not None and origin.step.index == second.index
    assert origin.cause.endswith("produced output after:args.0 (10 Inf of 10) from finite inputs")


@recorder.paper_step("Algorithm 1, step 4", description="clip the gradient norm, in place")
def clip(params: list[nn.Parameter], max_norm: float = 0.01) -> torch.Tensor:
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


def test_a_step_that_changes_its_inputs_grads_in_place_replays(tmp_path: Path) -> None:
    """Gradient clipping as a paper step changes its parameters' .grad in place: recorded as
    after:args.0.0:grad, which the replay did not produce (every call a MISMATCH)."""
    torch.manual_seed(0)
    layer = nn.Linear(4, 4)
    path = tmp_path / "run.zarr"
    with recorder.record(path, model=layer, mode="full"):
        for _ in range(2):
            layer(torch.randn(8, 4)).pow(2).mean().backward()
            clip(list(layer.parameters()))
            layer.zero_grad()
    rec = replayer.open(path)
    for step in rec.steps.filter(name="clip"):
        result = replayer.replay(rec, step.index)
        assert result.match and {d.name for d in result.outputs} == {
            "output", "after:args.0.0:grad", "after:args.0.1:grad"}, [d.summary() for d in result.outputs]


@recorder.paper_step("Eq. 18", description="a running mean, updated in place")
class RunningMean(nn.Module):
    def forward(self, stat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        stat.mul_(0.9).add_(x.mean(0), alpha=0.1)
        return x - stat


@recorder.paper_step("Eq. 19", description="centred features")
class Centred(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mean = RunningMean()
        self.register_buffer("stat", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mean(self.stat, x) * 2


def test_an_inner_step_that_changes_its_input_in_place_is_compared_inside_its_parent(tmp_path: Path) -> None:
    """A module step inside another that updates an input in place (a running mean it is given):
    replaying the outer step compares the inner step's input as it left it, like its outputs."""
    path = tmp_path / "run.zarr"
    model = Centred()
    with recorder.record(path, model=model, mode="full"):
        for _ in range(2):
            model(torch.randn(8, 4))
    rec = replayer.open(path)
    outer = replayer.replay(rec, 0)
    assert outer.match and [s.step.name for s in outer.inner] == ["RunningMean"]
    assert {d.name for d in outer.inner[0].diffs} == {"output", "after:args.0"}
    edited = replayer.replay(rec, 0, edit={"RunningMean/args.1": "x * 2"})
    assert not edited.inner[0].match and not {d.name: d for d in edited.inner[0].diffs}["after:args.0"].match


class DroppedResidual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.3, inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        self.drop(h)  # h itself is what the dropout changed
        return h.tanh() + x


def test_an_outer_step_whose_inner_step_changes_a_tensor_in_place_replays_its_backward(tmp_path: Path) -> None:
    """An inner step (an in-place dropout picked with ``modules=``) changes its argument in place, and the
    outer step goes on with it: the recording gives the outer step's tensor the change's history, as
    training has it unrecorded, and a replay of the outer step's backward, which taps the inner step
    again, does too, so it compares bit for bit."""
    def train(path: Path | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), DroppedResidual())
        with recorder.record(path, model=model, mode="full", modules="**") if path else contextlib.nullcontext():
            model(torch.randn(4, 8)).pow(2).sum().backward()
        return [p.grad for p in model.parameters()]

    path = tmp_path / "run.zarr"
    assert all(bits_equal(a, b) for a, b in zip(train(None), train(path), strict=True))
    rec = replayer.open(path)
    back = rec.steps.filter(name="DroppedResidual", phase="backward")[0]
    result = replayer.replay(rec, back.index)
    assert result.match, [d.summary() for d in result.outputs]
    assert {d.name for d in result.outputs} == {"args.0", "fc.weight", "fc.bias"}


@recorder.paper_step("Algorithm 3", step=2, description="SiLU gate: y * sigmoid(y)")
def silu_gate(y: torch.Tensor) -> torch.Tensor:
    return y.sigmoid() * y


@recorder.paper_step("Algorithm 3", step=1, description="the residual around the gate")
def gated_residual(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    return silu_gate(y) + y  # y reaches the output through the inner step and around it


def test_a_backward_replayed_without_comparing_its_inner_steps_still_runs_through_them(tmp_path: Path) -> None:
    """Autograd adds the two paths of ``y`` in the order of the recorded graph, which held the
    recorder's taps on the inner step. pdbg verify and bundle --verify (which leave the inner steps
    to be compared as steps of their own) replayed without the taps and reported 1-ULP differences
    that pdbg replay of the same step did not."""

    path = tmp_path / "run.zarr"
    w = torch.randn(64, 64, requires_grad=True)
    with recorder.record(path) as run:
        for _ in range(3):
            gated_residual(torch.randn(16, 64) @ w).pow(2).sum().backward()
            run.next_iteration()
    rec = replayer.open(path)
    for nested in (True, False):
        res = replayer.replay(rec, "gated_residual@iter=1:backward", nested=nested)
        assert res.compared and res.match, [d.summary() for d in res.outputs]
        assert [s.step.name for s in res.inner] == (["silu_gate"] if nested else [])
    verify = pdbg_here("verify", str(path), cwd=tmp_path)
    assert verify.returncode == 0 and "12 of 12 steps replayed bit for bit" in verify.stdout, verify.stdout
    shared = pdbg_here("bundle", str(path), "gated_residual@iter=2:backward", "-o", str(tmp_path / "b.pdbg"),
                       "--verify", cwd=tmp_path)
    assert shared.returncode == 0, shared.stdout + shared.stderr


@recorder.paper_step("Eq. 15", description="a critic layer")
class Critic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


def test_a_gradient_penalty_pass_is_named_not_a_mismatch(tmp_path: Path) -> None:
    """WGAN-GP: gradients taken with create_graph=True, then a backward through both graphs. The
    first pass's backward step replays bit for bit; the second's gradients hold second-order terms
    a replay of one step's backward does not compute: refused in one line that says so (it was a
    MISMATCH without a word of why), and `pdbg verify` lists it apart and exits 0."""
    torch.manual_seed(0)
    critic = Critic()
    opt = torch.optim.SGD(critic.parameters(), lr=0.1)
    path = tmp_path / "run.zarr"
    with recorder.record(path, model=critic, optimizer=opt, mode="full"):
        x = torch.randn(8, 4, requires_grad=True)
        y = critic(x)
        (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        (y.pow(2).mean() + (g.norm(dim=1) - 1).pow(2).mean()).backward()
        opt.step()
    rec = replayer.open(path)
    assert [s.phase for s in rec.steps] == ["forward", "backward", "backward"]
    assert replayer.replay(rec, 1).match
    with pytest.raises(ReplayError, match=r"^backward step 2 ran through the gradients an earlier backward pass "
                                          r"took with create_graph=True \(a gradient penalty\)"):
        replayer.replay(rec, 2)
    res = pdbg_here("verify", str(path), "--json", cwd=tmp_path)
    doc = json.loads(res.stdout)
    assert res.returncode == 0 and doc["matched"] == doc["replayed"] == 2 and len(doc["not_replayed"]) == 1


@recorder.paper_step("Eq. 3", description="a gradient penalty given the critic's output and its input")
def gradient_penalty(d_out: torch.Tensor, interp: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(d_out.sum(), interp, create_graph=True)
    return (g.norm(dim=1) - 1).pow(2).mean()


def test_a_penalty_given_the_critics_output_and_its_input_is_refused_not_a_mismatch(tmp_path: Path) -> None:
    """WGAN-GP as gradient_penalty(d_out, interp) with d_out = D(interp) made before the call: the graph linking
    the arguments is outside the step, and a replay given the recorded tensors raised torch's "not been used in
    the graph", a MISMATCH (verify exit 1). Refused in one line that says why and what replays, forward and
    backward; `pdbg replay` exits 2, `pdbg verify` lists it under "could not be replayed" and exits 0."""
    torch.manual_seed(0)
    critic = Critic()
    path = tmp_path / "run.zarr"
    with recorder.record(path, model=critic, mode="full"):
        interp = torch.randn(8, 4, requires_grad=True)
        (critic(interp).mean() + gradient_penalty(critic(interp), interp)).backward()
    rec = replayer.open(path)
    forward, *backward = [s.index for s in rec.steps if s.name == "gradient_penalty"]
    assert backward and all(rec.step(i).phase == "backward" for i in backward)
    why = (r"its arguments are linked by autograd history made outside the step, which a replay cannot rebuild: "
           r"it calls torch.autograd.grad with respect to its argument interp, and the recorded call was given "
           r"d_out computed from interp before the call .*a paper-step module holding the model")
    with pytest.raises(ReplayError, match=rf"^step {forward} \(gradient_penalty\): {why}"):
        replayer.replay(rec, forward)
    for index in backward:
        with pytest.raises(ReplayError, match=rf"^backward step {index}: rerunning its forward \(step {forward}, "
                                              rf"gradient_penalty\): {why}"):
            replayer.replay(rec, index)
    res = pdbg_here("replay", str(path), str(forward), cwd=tmp_path)
    assert res.returncode == 2 and "MISMATCH" not in res.stdout and len(res.stderr.splitlines()) == 1, res.stderr
    assert res.stderr.startswith(f"pdbg: error: step {forward} (gradient_penalty): its arguments are linked")
    res = pdbg_here("verify", str(path), "--json", cwd=tmp_path)
    doc = json.loads(res.stdout)
    assert res.returncode == 0 and doc["matched"] == doc["replayed"] and not doc["mismatches"], res.stdout
    refused = {e["step"]["index"] for e in doc["not_replayed"] if "linked by autograd" in e["reason"]}
    assert refused == {forward, *backward}, doc["not_replayed"]


def test_an_edit_on_a_second_order_step_is_refused_as_the_step_is(tmp_path: Path) -> None:
    """A no-op edit (x*1) of a gradient penalty pass's grad output was a MISMATCH "as an intervention
    makes it", while the same step without it is refused for the second-order terms a replay leaves
    out: it is refused for them too, not blamed on the edit."""
    torch.manual_seed(0)
    critic = Critic()
    path = tmp_path / "run.zarr"
    with recorder.record(path, model=critic, mode="full"):
        x = torch.randn(8, 4, requires_grad=True)
        y = critic(x)
        (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        (y.pow(2).mean() + (g.norm(dim=1) - 1).pow(2).mean()).backward()
    with pytest.raises(ReplayError, match=r"^backward step 2 ran through the gradients .*; a replay with an "
                                          r"intervention is refused alike: what it changes cannot be told from what "
                                          r"those terms change$"):
        replayer.replay(path, 2, edit={"grad_output:output": "x * 1"})
    res = pdbg_here("replay", str(path), "2", "--edit", "grad_output:output=x*1", cwd=tmp_path)
    assert res.returncode == 2 and "MISMATCH" not in res.stdout and "refused alike" in res.stderr, res.stdout


def test_a_first_order_pass_after_one_with_create_graph_replays(tmp_path: Path) -> None:
    """After autograd.grad(..., create_graph=True) through a call, a plain second autograd.grad
    through the same retained graph was refused as holding second-order terms, though its gradients
    are first order: it replays bit for bit now, and a pass through the gradients is still refused."""
    torch.manual_seed(0)
    critic = Critic()
    path = tmp_path / "run.zarr"
    with recorder.record(path, model=critic, mode="full"):
        x = torch.randn(8, 4, requires_grad=True)
        y = critic(x)
        (g1,) = torch.autograd.grad(y[:, 0].sum(), x, create_graph=True)
        (g2,) = torch.autograd.grad(y[:, 1].sum(), x, retain_graph=True)  # first order, the same graph
        (y.pow(2).mean() + g1.pow(2).mean()).backward()  # through g1's graph: second order
    rec = replayer.open(path)
    assert [s.phase for s in rec.steps] == ["forward", "backward", "backward", "backward"]
    assert replayer.replay(rec, 1).match and replayer.replay(rec, 2).match
    with pytest.raises(ReplayError, match=r"^backward step 3 ran through the gradients an earlier backward pass "):
        replayer.replay(rec, 3)
    what_if = replayer.replay(rec, 2, edit={"grad_output:output": "x * 2"})  # meant to differ: not refused
    assert what_if.compared and not what_if.match


def test_a_bundle_of_a_step_that_cannot_replay_names_the_recordings_step(tmp_path: Path) -> None:
    """`pdbg bundle RUN 2 --verify` of a second-order step said "backward step 1" (its number in the
    unwritten bundle) and pointed at an earlier pass the bundle lacks; a step called with a value that
    is not data said "step 0". Both name the recording's step now, and without --verify the bundle is
    written with the reason a replay of it will be refused."""
    torch.manual_seed(0)
    critic = Critic()
    path = tmp_path / "run.zarr"
    with recorder.record(path, model=critic, mode="full"):
        Ops.apply(lambda t: t * 2, torch.randn(3))
        x = torch.randn(8, 4, requires_grad=True)
        y = critic(x)
        (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        (g.norm(dim=1) - 1).pow(2).mean().backward()  # the penalty alone: no grad output, second order
    rec = replayer.open(path)
    assert [s.phase for s in rec.steps] == ["forward", "forward", "backward", "backward"]
    with pytest.raises(ReplayError, match=r"^backward step 3 ran through the gradients .*that earlier pass's "
                                          r"backward step replays \(in the recording this bundle was made from: "
                                          r"bundle that step, or the whole iteration with --iteration\)$"):
        replayer.bundle(rec, 3, tmp_path / "b.pdbg", verify=True)
    assert not (tmp_path / "b.pdbg").exists()
    info = replayer.bundle(rec, 3, tmp_path / "b.pdbg")
    assert info.main_step == 1 and info.unreplayable is not None and \
        info.unreplayable.startswith("backward step 3 ran through the gradients")
    shell = pdbg_here("bundle", str(path), "3", "-o", str(tmp_path / "c.pdbg"), cwd=tmp_path)
    assert shell.returncode == 0 and "warning: a replay of it will be refused: backward step 3 ran" in shell.stdout
    assert replayer.bundle(rec, 2, tmp_path / "first.pdbg").unreplayable is None  # the first pass replays
    lam = f"the lambda {__name__}:test_a_bundle_of_a_step_that_cannot_replay_names_the_recordings_step.<locals>." \
        "<lambda>"
    with pytest.raises(ReplayError, match=r"^step 0 \(Ops\.apply\) was called with the lambda "):
        replayer.bundle(rec, 0, tmp_path / "d.pdbg", verify=True)
    assert replayer.bundle(rec, 0, tmp_path / "d.pdbg").unreplayable.startswith(
        f"step 0 (Ops.apply) was called with {lam}, which could not be recorded as data (a lambda has no name")


@recorder.paper_step("Eq. 14", description="an encoder with SiLU activations")
class SiluEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(10, 24)
        self.l2 = nn.Linear(24, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.silu(self.l2(nn.functional.silu(self.l1(x))))


@pytest.mark.parametrize("wrt", ["input", "params"])
def test_a_pass_with_create_graph_through_silu_replays_bit_for_bit(tmp_path: Path, wrt: str) -> None:
    """A gradient penalty's first pass (autograd.grad with create_graph=True) ran its backward with
    grad mode on, under which torch computes SiLU's gradient by another formula: the replay takes
    the gradients with create_graph too, and matches bit for bit (it was a MISMATCH of ~17 ULP)."""
    torch.manual_seed(0)
    enc = SiluEncoder()
    path = tmp_path / "run.zarr"
    with recorder.record(path, model=enc, mode="full"):
        x = torch.randn(16, 10, requires_grad=wrt == "input")
        loss = enc(x).pow(2).mean()
        targets = [x] if wrt == "input" else list(enc.parameters())
        grads = torch.autograd.grad(loss, targets, create_graph=True)
        (loss + sum(g.pow(2).sum() for g in grads)).backward()
    rec = replayer.open(path)
    assert [s.phase for s in rec.steps] == ["forward", "backward", "backward"]
    assert rec.step(1).settings["grad_enabled"] is True
    result = replayer.replay(rec, 1)
    assert result.match and result.outputs, [d.summary() for d in result.outputs]
    compared = [r for r in rec.step(1).records if r.role in ("grad_input", "param_grad")]
    assert len(compared) == len(result.outputs) == (1 if wrt == "input" else 4)
    for r in compared:
        replayed = result.values[r.name if r.role == "grad_input" else f"param_grad:{r.name}"]
        assert bits_equal(rec.step(1).rec.rank.tensor(r), replayed)
    assert not any(v.requires_grad for v in result.values.values())


def test_a_parameters_gradient_hook_does_not_change_the_calls_own_grad(tmp_path: Path) -> None:
    """A pruning mask applied by a hook on a parameter's gradient: the recorded parameter grad is
    the call's own, as its backward computed it before the hook masked the total, so a replay
    (without the hook) matches it bit for bit, with no warning about the hook (it was a MISMATCH,
    blamed on the hook). The .grad the optimizer saw is that grad masked."""
    torch.manual_seed(0)
    critic = Critic()
    mask = (torch.rand(4, 4) > 0.5).float()
    critic.fc.weight.register_hook(lambda g: g * mask)
    path = tmp_path / "run.zarr"
    with recorder.record(path, model=critic, mode="full"):
        critic(torch.randn(8, 4)).pow(2).sum().backward()
    rec = replayer.open(path)
    result = replayer.replay(rec, 1)
    assert result.match and {"fc.weight", "fc.bias"} <= set(result.diffs), result.diffs
    assert not any("gradient hooks" in w for w in result.warnings), result.warnings
    own = rec.step(1).tensor("fc.weight", "param_grad")
    assert not torch.equal(own, critic.fc.weight.grad) and torch.equal(own * mask, critic.fc.weight.grad)


def test_the_relative_difference_where_the_recorded_value_is_zero_is_inf() -> None:
    """A replayed value that is not 0 where the recorded one is: its relative difference is inf
    (it was 3.67e+307), and where both are 0 it is none."""
    from replayer.compare import compare

    diff = compare("w", "param_grad", torch.tensor([0.0, 0.0, 2.0]), torch.tensor([0.5, 0.0, 2.0]))
    assert not diff.match and diff.max_rel_diff == math.inf and diff.mismatched == 1


@recorder.paper_step("Eq. 16", description="learned queries, and a projection")
class Queries(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Parameter(torch.randn(4, 4))
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q, x @ self.w


@recorder.paper_step("Eq. 16b", description="learned queries, used too")
class UsedToo(Queries):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q, x @ self.w + x @ self.q


def test_a_parameter_returned_as_it_is_is_left_out_of_the_comparison(tmp_path: Path) -> None:
    """A module step returning one of its parameters (learned queries): the caller's use of it sends
    a gradient straight into that parameter's, which this step's backward does not compute (it was a
    MISMATCH). The step's graph does not use it: its backward records no gradient for it, and the
    others are compared. Used inside the step too, its grad is the call's own (that use's), and
    compared."""
    torch.manual_seed(0)
    queries = Queries()
    path = tmp_path / "run.zarr"
    with recorder.record(path, model=queries, mode="full"):
        q, h = queries(torch.randn(8, 4, requires_grad=True))
        (q.sum() + h.pow(2).sum()).backward()
    rec = replayer.open(path)
    assert "q" not in {r.name for r in rec.step(1).records if r.role == "param_grad"}
    result = replayer.replay(rec, 1)
    assert result.match and set(result.diffs) == {"w", "args.0"}, result.diffs
    assert not any("returned as they are" in w for w in result.warnings), result.warnings

    used = UsedToo()
    with recorder.record(tmp_path / "used.zarr", model=used, mode="full"):
        q, h = used(torch.randn(8, 4, requires_grad=True))
        (q.sum() + h.pow(2).sum()).backward()
    result = replayer.replay(replayer.open(tmp_path / "used.zarr"), 1)
    assert result.match and set(result.diffs) == {"q", "w", "args.0"}, (result.diffs, result.warnings)


@recorder.paper_step("Eq. 9", description="the output projection, tied to the embedding")
class TiedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 11, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(h)


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.mix, self.head = nn.Embedding(11, 8), nn.Linear(8, 8), TiedHead()
        self.head.proj.weight = self.embed.weight  # weight tying (GPT-2, T5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(ids))))


def test_a_weight_tied_outside_the_step_is_compared_as_the_steps_own_share(tmp_path: Path) -> None:
    """The head's weight is the embedding's: the .grad is the total over both uses, and the head's
    backward step records its own share, which a replay of it computes: compared, and a match (a
    false MISMATCH of 80 elements before the tie was noticed, then left out of the comparison)."""
    torch.manual_seed(0)
    model = TiedLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "run.zarr"
    with recorder.record(path, model=model, optimizer=opt, mode="full", modules=["mix"]):
        for _ in range(2):
            ids = torch.randint(0, 11, (3, 5))
            nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
            opt.step()
            opt.zero_grad()
    rec = replayer.open(path)
    back = rec.step("Eq. 9:backward")
    result = replayer.replay(rec, back.index)
    assert result.match and set(result.diffs) == {"args.0", "proj.weight"}, result.diffs
    assert not any("not compared" in w for w in result.warnings), result.warnings
    assert all(replayer.replay(rec, i).match for i in range(len(rec)))
    mix = replayer.replay(rec, rec.step("mix:backward").index)  # not tied: its grads compared
    assert {"weight", "bias"} <= set(mix.diffs)


@recorder.paper_step("Eq. 6", name="block#1")
def hashed(x: torch.Tensor) -> torch.Tensor:
    return x + 1


@recorder.paper_step("Eq. 4:", name="enc:forward")
def coloned(x: torch.Tensor) -> torch.Tensor:
    return x * 3


def test_a_name_or_label_holding_selector_syntax_is_selected_by_itself(tmp_path: Path) -> None:
    """Names and labels may hold '#', ':' or '@' (paper_step accepts them): written out whole, they
    select their steps (they were read as a call number or a phase: "no step matches", or "invalid
    step selector"). The selector syntax still works for every other name."""
    path = tmp_path / "run.zarr"
    with recorder.record(path, mode="full") as session:
        for _ in range(2):
            hashed(torch.ones(2))
            coloned(torch.ones(2))
            session.next_iteration()
    rec = replayer.open(path)
    assert [s.index for s in rec.steps.select("block#1")] == [0, 2]
    assert [s.index for s in rec.steps.select("enc:forward")] == [1, 3] and rec.step("Eq. 4:").index == 1
    assert rec.step("Eq. 6@iter=1").index == 2  # the selector syntax, for a label without it
    assert rec.step("block#1@iter=1").index == 2 and rec.step("enc:forward#0:forward").index == 1
    assert all(rec.step(s.selector).index == s.index for s in rec.steps)  # rec.step takes a selector back
    res = pdbg_here("replay", str(path), "block#1", cwd=tmp_path)
    assert res.returncode == 0 and res.stdout.startswith("step 0: Eq. 6 (block#1)"), res.stderr


@recorder.paper_step("E\u0301quation 5 \u2014 re\u0301sidu")  # decomposed (NFD), as pasted from a PDF
def residu(x: torch.Tensor) -> torch.Tensor:
    return x + 1


@recorder.paper_step("Eq. 1")
def filter_step(x: torch.Tensor) -> torch.Tensor:  # (def \ufb01lter_\uff53\uff54\uff45\uff50: Python names it so)
    return x * 2


class Keyed(nn.Module):
    """ModuleDict keys in NFD (a macOS file name), holding control characters, brackets, CJK and a
    combining mark."""

    KEYS = ("cafe\u0301", "a\nFAKE LINE", "tab\there", "esc\x1b[31mRED", "x[0]", "注意力", "\u03b5\u0302_block")

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({k: nn.Linear(4, 4) for k in self.KEYS})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.blocks.values():
            x = torch.tanh(m(x))
        return residu(filter_step(x))


@pytest.fixture(scope="module")
def keyed_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keyed") / "run.zarr"
    torch.manual_seed(0)
    model = Keyed()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with recorder.record(path, model=model, optimizer=opt, modules=["**"]):
        for _ in range(2):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    return path


NFC_LABEL = "\u00c9quation 5 \u2014 r\u00e9sidu"  # as typed on a keyboard


def test_names_labels_and_paths_are_selected_under_unicode_normalisation(keyed_run: Path, tmp_path: Path) -> None:
    """A label recorded in NFD did not match the same text typed in NFC ("no step matches 'Équation 5 —
    résidu'; ... paper labels: Équation 5 — résidu"), nor a ModuleDict key in NFD its path typed in NFC,
    nor a name as written in the source (def ﬁlter_ｓｔｅｐ, which Python normalises to filter_step).
    They are compared under NFC (NFKC for identifiers) on both sides; what is stored is unchanged."""
    rec = replayer.open(keyed_run)
    step = rec.step(NFC_LABEL)
    assert step.name == "residu" and step.paper["label"] == "E\u0301quation 5 \u2014 re\u0301sidu"
    assert len(rec.steps.filter(label=NFC_LABEL)) == 4 and len(rec.steps.select(f"{NFC_LABEL}:backward")) == 2
    assert rec.step("blocks.caf\u00e9@iter=1").module_path == "blocks.cafe\u0301"
    assert len(rec.steps.filter(module_path="blocks.caf\u00e9")) == 4
    assert rec.step("\ufb01lter_\uff53\uff54\uff45\uff50").name == "filter_step"
    assert len(rec.steps.filter(name="\ufb01lter_step")) == 4
    found = pdbg_here("find", str(keyed_run), f"{NFC_LABEL}@iter=1", cwd=tmp_path)
    assert found.returncode == 0 and found.stdout.startswith(f"step {rec.step(f'{NFC_LABEL}@iter=1').index}: "), \
        found.stdout + found.stderr


def test_control_characters_in_module_paths_are_printed_escaped_and_select_their_steps(keyed_run: Path,
                                                                                         tmp_path: Path) -> None:
    """A ModuleDict key "a\\nFAKE LINE" was printed raw (a listing's line broke in two, a tab went out raw) and
    could not be selected ("invalid step selector"). Every listing escapes it (\\n, \\t, \\x1b), and that
    escaped form, or the raw text, selects the step."""
    rec = replayer.open(keyed_run)
    for raw in ("a\nFAKE LINE", "tab\there", "esc\x1b[31mRED"):
        printed = raw.replace("\n", "\\n").replace("\t", "\\t").replace("\x1b", "\\x1b")
        step = rec.step(f"blocks.{printed}@iter=1")
        assert step.module_path == f"blocks.{raw}" and rec.step(f"blocks.{raw}@iter=1").index == step.index
        assert printed in describe(step) and raw not in describe(step) and printed in repr(step)
        res = pdbg_here("find", str(keyed_run), f"blocks.{printed}@iter=1", cwd=tmp_path)
        assert res.stdout == f"step {step.index}: Linear at blocks.{printed}, forward, iteration 1, call " \
                             f"{step.call}\n", res.stdout + res.stderr
    listing = pdbg_here("replay", str(keyed_run), "blocks.*@iter=1#1", cwd=tmp_path)
    assert listing.stdout.startswith("step ") and "\t" not in listing.stdout and "\nFAKE" not in listing.stdout, \
        listing.stdout


def test_replays_table_is_aligned_in_terminal_cells(keyed_run: Path, tmp_path: Path) -> None:
    """The replay's tensor table padded names by their length in characters: a CJK name (two columns a
    character) or one with a combining mark shifted its row. Every row is as wide as the header, in cells."""
    from rich.cells import cell_len

    res = pdbg_here("replay", str(keyed_run), "Keyed@iter=1:backward", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.lstrip().startswith("tensor "))
    rows = [line for line in lines[at + 1:] if line.startswith("  blocks.")]
    wide = [r for r in rows if "注意力" in r or "\u0302" in r]
    assert len(wide) == 4 and {cell_len(r) for r in wide} == {cell_len(lines[at])}, [lines[at], *wide]
    assert {cell_len(r[:r.index(" yes ")]) for r in rows} == {cell_len(lines[at][:lines[at].index(" match ")])}
    assert {cell_len(r) for r in rows} == {cell_len(lines[at])} and any("a\\nFAKE LINE" in r for r in rows), rows


@recorder.paper_step("Eq. 7", name="a")
def short_named(x: torch.Tensor) -> torch.Tensor:
    return x + 1


@recorder.paper_step("Algorithm 3, a label far longer than its column", name="n" * 60)
def long_named(x: torch.Tensor) -> torch.Tensor:
    return x * 3


def test_info_table_columns_stay_aligned_with_short_and_long_names(tmp_path: Path) -> None:
    """pdbg info's table of paper steps: a name shorter than the header put every row a column off
    it, one long name widened every row, and a long label was cut without a mark. Names and labels
    are cut with "…" and the columns line up with the header."""
    path = tmp_path / "run.zarr"
    with recorder.record(path, mode="full"):
        long_named(short_named(torch.ones(2)))
    lines = pdbg_here("info", str(path), cwd=tmp_path).stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.lstrip().startswith("step"))
    header, rows = lines[at], lines[at + 1:at + 3]
    assert [r.split()[0] for r in rows] == ["a", "n" * 39 + "…"]
    assert "Algorithm 3, a label far lo…" in rows[1]
    for row in rows:
        assert row.index(" 1 ") + 1 == header.index("forward") + 6 and len(row) == len(rows[0]), (header, row)


@recorder.paper_step("Eq. \u202e9 qE")
def overridden(x: torch.Tensor) -> torch.Tensor:
    return x - 1


@recorder.paper_step("Eq. 8\u2028(two lines)", name="\u0394_\u6ce8\u610f")
def separated(x: torch.Tensor) -> torch.Tensor:
    return x / 2


def test_info_table_escapes_bidirectional_controls_before_it_pads(tmp_path: Path) -> None:
    """A label with a right-to-left override was padded and cut on its raw width and escaped afterwards by
    the output stream (\\u202e: six cells more), and a LINE SEPARATOR went out raw: that row stood out of the
    table. They are escaped first, and every row is as wide as the others, in cells."""
    from rich.cells import cell_len

    path = tmp_path / "run.zarr"
    with recorder.record(path, mode="full"):
        separated(overridden(short_named(torch.ones(2))))
    lines = pdbg_here("info", str(path), cwd=tmp_path).stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.lstrip().startswith("step"))
    rows = lines[at + 1:at + 4]
    assert "Eq. \\u202e9 qE" in rows[1] and "Eq. 8\\u2028(two lines)" in rows[2] and "\u202e" not in "".join(lines)
    widths = {cell_len(r[:r.index("     1 ")]) for r in rows}
    assert len(widths) == 1, [(cell_len(r), r) for r in rows]


UNGUARDED_SCRIPT = '''
import collections, sys, torch
import recorder

Pair = collections.namedtuple("Pair", ["y", "norm"])


@recorder.paper_step("Eq. 5")
def pair(x):
    return Pair(x * 2, x.norm())


with recorder.record(sys.argv[1], mode="full"):
    p = pair(torch.randn(8, 4, requires_grad=True))
    (p.y.sum() + p.norm).backward()
'''


def test_a_name_an_unguarded_script_sets_is_named_as_the_cause(tmp_path: Path) -> None:
    """A script with no main guard is loaded for its definitions only: a name set by a statement
    left out (a namedtuple made at the top level) is not defined in the replay. The replay says so,
    naming it and what to do (a NameError without a word), forward and backward."""
    (tmp_path / "train.py").write_text(UNGUARDED_SCRIPT)
    made = python("train.py", str(tmp_path / "run.zarr"), cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    rec = replayer.open(tmp_path / "run.zarr")
    forward = replayer.replay(rec, 0)
    assert not forward.match and forward.exception == "NameError: name 'Pair' is not defined"
    assert any(w.startswith("a likely cause: Pair is set at the top level of the training script") for w in
               forward.warnings), forward.warnings
    assert any("names they set are not defined: Pair" in w for w in forward.warnings), forward.warnings
    with pytest.raises(ReplayError, match=r"raised NameError: name 'Pair' is not defined \(Pair is set at the top "
                                          r"level of the training script .*put the training under such a guard"):
        replayer.replay(rec, 1)


UNGUARDED_READER = '''
import os, sys, torch
import recorder

host = os.environ.get("TRAIN_HOST", "local")  # a call: left out of a replay's loading
URL = f"http://{host}:1"  # reads it


def endpoint(path=URL):  # a default read when the function is defined
    return path


class Config:
    where = URL
    scale = 2.0


@recorder.paper_step("Eq. 6")
def scaled(x):
    return torch.tanh(x) * Config.scale if "Config" in globals() else torch.tanh(x) * 2.0


with recorder.record(sys.argv[1], mode="full"):
    scaled(torch.randn(8))
'''


def test_a_definition_reading_a_name_an_unguarded_script_skips_is_skipped_too(tmp_path: Path) -> None:
    """Statements kept from an unguarded script that read a name only a skipped statement sets (an
    f-string, a function's default, a class attribute) are left out too, and named: loading the
    script failed with a NameError, and nothing could be replayed."""
    (tmp_path / "train.py").write_text(UNGUARDED_READER)
    made = python("train.py", str(tmp_path / "run.zarr"), cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    result = replayer.replay(replayer.open(tmp_path / "run.zarr"), 0)
    assert result.match, (result.exception, result.warnings)
    assert any("(5 top-level statements skipped; names they set are not defined: host, URL, endpoint, Config)" in w
               for w in result.warnings), result.warnings


UNGUARDED_LABEL = """
import sys, unicodedata
import torch
import recorder

LABEL = unicodedata.normalize("NFC", "\u00c9q. 3 \u2014 m\u00e9lange")


@recorder.paper_step(LABEL)
def m\u00e9lange(x):
    return x * 2


with recorder.record(sys.argv[1]):
    m\u00e9lange(torch.randn(3))
"""


def test_a_step_an_unguarded_scripts_loading_left_out_is_said_to_be(tmp_path: Path) -> None:
    """A label computed by a call (LABEL = unicodedata.normalize(...)) in a script without a main guard: its
    loading leaves that statement out, and the decorated function with it, and the replay said "__main__ has
    no mélange now (renamed or removed since the recording?)". It names the statement left out and why, and
    what to do."""
    (tmp_path / "train.py").write_text(UNGUARDED_LABEL, encoding="utf-8")
    made = python("train.py", str(tmp_path / "run.zarr"), cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    with pytest.raises(ReplayError) as raised:
        replayer.replay(replayer.open(tmp_path / "run.zarr"), 0)
    message = str(raised.value)
    assert "renamed or removed" not in message and message.startswith("__main__ has no m\u00e9lange: the training "), \
        message
    assert "m\u00e9lange is defined at line 10 (def m\u00e9lange(x):), left out as it reads LABEL as it runs, set at " \
           "line 6 (LABEL = unicodedata.normalize(\"NFC\", \"\u00c9q. 3 \u2014 m\u00e9lange\")), a statement left " \
           "out as it calls a function; put the script's training under if __name__ == '__main__':" in message, message
    res = pdbg_here("replay", str(tmp_path / "run.zarr"), "m\u00e9lange", cwd=tmp_path)
    assert res.returncode == 2 and "a statement left out as it calls a function" in res.stderr, res.stderr


UNGUARDED_ARGV = """
import os
import sys
import torch
import recorder

out = sys.argv[1] if "PDBG_TEST_OUT" not in os.environ else os.environ["PDBG_TEST_OUT"]
data = os.environ["PDBG_TEST_DATA"]  # set when recorded, not when replayed
scale = float(sys.argv[2]) if len(sys.argv) > 2 else 3.0
label = f"into {out}"


@recorder.paper_step("Eq. 1")
def triple(x):
    return x * 3


with recorder.record(out, mode="full"):
    triple(torch.randn(4))
"""


def test_an_unguarded_scripts_definition_that_fails_when_loaded_is_left_out(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """`data = os.environ["PDBG_TEST_DATA"]` at an unguarded script's top level: no call in it, so it
    was kept as a definition, and it raises in a replaying process without that variable (a bundle's
    repro.py, a notebook): loading the script failed and nothing replayed. It is left out, with what
    reads what it sets, and named; the step replays. (`out = sys.argv[1]` loads: the script's top
    level sees the arguments it was recorded with, whatever the replaying process's are.)"""
    (tmp_path / "train.py").write_text(UNGUARDED_ARGV)
    made = subprocess.run([sys.executable, "train.py", str(tmp_path / "run.zarr")], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, check=False, env={**env(), "PDBG_TEST_DATA": "/data"})
    assert made.returncode == 0, made.stderr
    monkeypatch.setattr(sys, "argv", ["repro.py"])
    monkeypatch.delenv("PDBG_TEST_DATA", raising=False)
    result = replayer.replay(replayer.open(tmp_path / "run.zarr"), 0)
    assert result.match, (result.exception, result.warnings)
    assert any("1 of its definitions failed when loaded and were left out (line 8: KeyError: 'PDBG_TEST_DATA'), "
               "and what reads them; names not defined: data" in w for w in result.warnings), result.warnings


class Handle:
    """An object a step returns that is not data (its repr holds its address)."""

    __slots__ = ("value",)

    def __init__(self, value: float) -> None:
        self.value = value


@recorder.paper_step("Eq. 17", description="a value, and a handle that is not data")
def with_handle(x: torch.Tensor) -> tuple[torch.Tensor, Handle]:
    return x * 2, Handle(1.0)


def test_an_output_object_that_is_not_data_is_compared_by_its_type(tmp_path: Path) -> None:
    """An object in a step's output that cannot be recorded as data is recorded by its type and repr,
    and the repr holds its address: compared by type, the replay matches (it always differed in
    'output structure'), in what was compared: the object itself is said not to be."""
    path = tmp_path / "run.zarr"
    with recorder.record(path, mode="full"):
        with_handle(torch.randn(4))
    assert "$opaque" in json.dumps(replayer.open(path).step(0).output_structure)
    result = replayer.replay(replayer.open(path), 0)
    assert result.match and [d.name for d in result.outputs] == ["output.0"], result.outputs
    assert result.not_compared == ["output.1 (a tests Handle)"]
    assert "not compared: output.1 (a tests Handle), not recorded as data (a replay compares its type alone)" in \
        result.warnings
    res = pdbg_here("replay", str(path), "0", cwd=tmp_path)
    assert res.stdout.rstrip().endswith("MATCH: bit for bit, in what was compared; not compared (not recorded as "
                                        "data): output.1 (a tests Handle)"), res.stdout
    res = pdbg_here("verify", str(path), cwd=tmp_path)
    assert res.returncode == 0 and "1 step of those matched in what was compared; not recorded as data, so not " \
        "compared:\n  step 0: Eq. 17 (with_handle), forward, iteration 0, call 0: output.1 (a tests Handle)" in \
        res.stdout
    info = replayer.bundle(replayer.open(path), 0, tmp_path / "one.pdbg", verify=True)
    assert info.verified is True and info.not_compared == ["output.1 (a tests Handle)"]


@recorder.paper_step("Eq. 17", description="a value kept in a handle that is not data")
def only_handle(x: torch.Tensor) -> Handle:
    return Handle(x.exp())


def test_an_output_not_recorded_as_data_is_never_a_match(tmp_path: Path) -> None:
    """A step whose output could not be recorded as data (only its type and repr are) was compared by its
    type alone: its replay was a bitwise MATCH, `pdbg verify` counted it bit for bit, an edit that changed
    every value it held was NO CHANGE, and the TUI said "bitwise match". Nothing was compared, and each
    says so (the step pane too), naming what was not recorded."""
    from tui import views
    from tui.app import render_replay

    path = tmp_path / "run.zarr"
    with recorder.record(path, mode="full"):
        only_handle(torch.randn(4))
    rec = replayer.open(path)
    result = replayer.replay(rec, 0)
    assert not result.match and not result.compared and result.not_compared == ["output (a tests Handle)"]
    assert result.warnings[0] == ("the step's output was not recorded as data, which a replay compares by its type "
                                  "alone: output (a tests Handle); and the step changed none of its inputs, "
                                  "parameters or buffers in place: nothing was compared")
    assert render_replay(result).plain.startswith("replay of step 0: nothing compared: the output was not recorded "
                                                  "as data: output (a tests Handle)")
    edited = replayer.replay(rec, 0, edit={"args.0": "x * 100"})
    assert not edited.match and not edited.compared
    res = pdbg_here("replay", str(path), "0", "--edit", "args.0=x*100", cwd=tmp_path)
    assert res.returncode == 1 and "NO CHANGE" not in res.stdout and res.stdout.rstrip().endswith(
        "NOTHING COMPARED: the step's output was not recorded as data: output (a tests Handle)"), res.stdout
    doc = json.loads(pdbg_here("replay", str(path), "0", "--json", cwd=tmp_path).stdout)
    assert doc["match"] is False and doc["compared"] is False and doc["not_compared"] == ["output (a tests Handle)"]
    res = pdbg_here("verify", str(path), cwd=tmp_path)
    assert res.returncode == 2 and "bit for bit" not in res.stdout and "nothing was compared" in res.stderr
    assert views.step_view(rec.step(0)).unrecorded == ["output (a tests Handle)"]  # the step pane's line


@recorder.paper_step("Eq. 18", description="normalise with batch statistics, update the running ones")
class Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(x)


def test_buffers_a_call_updates_are_compared_with_what_the_next_call_found(tmp_path: Path) -> None:
    """BatchNorm in training updates its running statistics in place: a replay compares them, after
    the call, with what the module's next recorded call found (they were never compared: a replay
    that did not update them was a bitwise MATCH). A module in eval mode leaves them: not compared."""
    torch.manual_seed(0)
    norm = Norm()
    path = tmp_path / "run.zarr"
    with recorder.record(path, model=norm, mode="full"):
        for _ in range(2):
            norm(torch.randn(8, 4))
        norm.eval()
        norm(torch.randn(8, 4))
        norm(torch.randn(8, 4))
    rec = replayer.open(path)
    result = replayer.replay(rec, 0)
    assert result.match and {d.name for d in result.outputs} == {
        "output", "after:bn.running_mean", "after:bn.running_var", "after:bn.num_batches_tracked"}

    def frozen(bn: nn.Module) -> nn.Module:
        bn.momentum = 0.0  # running statistics left as they were
        return bn

    swapped = replayer.replay(rec, 0, swap={"bn": frozen})
    assert not swapped.match and swapped.diffs["output"].match
    assert not swapped.diffs["after:bn.running_mean"].match
    assert "against what the next call, step 1, found" in swapped.diffs["after:bn.running_mean"].reason
    assert {d.name for d in replayer.replay(rec, 2).outputs} == {"output"}  # eval: nothing updated


@recorder.paper_step("Eq. 16", description="a softmax at an annealed temperature")
class Tempered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("tau", torch.tensor(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.fc(x) / self.tau, -1)


@pytest.mark.parametrize("between", ["anneal", "cast"])
def test_a_buffer_changed_between_calls_by_the_loop_is_not_a_mismatch(tmp_path: Path, between: str) -> None:
    """A temperature the training loop anneals (``tau.fill_``), or the model cast to bfloat16
    mid-run: the step's next call finds its buffer changed, though the call never touched it. The
    replay (which left it as recorded) matches and says the buffer was changed outside the step;
    it was a MISMATCH on after:tau. An intervention that leaves a buffer a call updates is still one."""
    torch.manual_seed(0)
    model = Tempered()
    path = tmp_path / "run.zarr"
    dtype = torch.float32
    with recorder.record(path, model=model, mode="full"):
        for i in range(3):
            if between == "anneal":
                model.tau.fill_(1.0 - 0.2 * i)
            elif i == 1:
                model.to(torch.bfloat16)
                dtype = torch.bfloat16
            model(torch.randn(2, 4, dtype=dtype)).float().pow(2).sum().backward()
    rec = replayer.open(path)
    forwards = [s.index for s in rec.steps if s.phase == "forward"]
    result = replayer.replay(rec, forwards[0])
    assert result.match and [d.name for d in result.outputs] == ["output"], [d.summary() for d in result.outputs]
    assert (f"not compared: tau, changed between this call and the next (step {forwards[1]}) by code outside the "
            "step, not by the call (the replay left it as recorded)") in result.warnings
    assert all(replayer.replay(rec, i).match for i in range(len(rec)))


# What Tally adds to its buffer at each call, times its input's mean: changed after a recording, a
# replay's in-place update of the buffer is wrong.
TALLY_SCALE = [1.0]


@recorder.paper_step("Eq. 17", description="a running total of the inputs, kept in a buffer")
class Tally(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("total", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.total.add_(x.detach().mean(0) * TALLY_SCALE[0])
        return self.fc(x)


def test_a_checkpoint_loaded_between_calls_is_not_a_mismatch_of_the_buffers(tmp_path: Path) -> None:
    """load_state_dict rolls the buffers back to a checkpoint between two calls: the next call finds
    what the checkpoint held, not what the call left. The recording notes it (the buffer's version
    counter moved between the calls), and the replay of the call before does not compare the buffer
    with it, and says so (it was a MISMATCH on after:total, and `pdbg verify` exited 1). A wrong
    in-place update by the call itself is still a mismatch."""
    torch.manual_seed(0)
    model = Tally()
    path = tmp_path / "run.zarr"
    with recorder.record(path, model=model, mode="full"):
        for i in range(4):
            if i == 1:
                checkpoint = {k: v.clone() for k, v in model.state_dict().items()}
            if i == 3:
                model.load_state_dict(checkpoint)
            model(torch.randn(8, 4))
    rec = replayer.open(path)
    assert [s.phase for s in rec.steps] == ["forward"] * 4
    before = replayer.replay(rec, 2)
    assert before.match and [d.name for d in before.outputs] == ["output"], [d.summary() for d in before.outputs]
    assert ("not compared: total, written or replaced between this call and the next (step 3) by code outside the "
            "step (load_state_dict, .to(), a reset): what that call found is not this call's result") in before.warnings
    assert [n for n in rec.step(3).extra.get("notes", []) if layout.BUFFERS_WRITTEN_NOTE in n] == [
        f"total: {layout.BUFFERS_WRITTEN_NOTE}"]
    assert not any(layout.BUFFERS_WRITTEN_NOTE in n for i in (1, 2) for n in rec.step(i).extra.get("notes", []))
    kept = replayer.replay(rec, 1)
    assert kept.match and [d.name for d in kept.outputs] == ["output", "after:total"]
    done = pdbg_here("verify", str(path), cwd=tmp_path)
    assert done.returncode == 0 and "4 of 4 steps replayed bit for bit" in done.stdout, done.stdout + done.stderr
    TALLY_SCALE[0] = 2.0
    try:
        wrong = replayer.replay(rec, 1)
        assert not wrong.match and wrong.diffs["output"].match and not wrong.diffs["after:total"].match
        assert "against what the next call, step 2, found" in wrong.diffs["after:total"].reason
        assert replayer.replay(rec, 2).match  # (its buffer is not compared: the checkpoint's is no result of it)
    finally:
        TALLY_SCALE[0] = 1.0


@pytest.mark.parametrize("noted", [True, False])
def test_a_buffer_converted_between_calls_it_updates_is_not_a_mismatch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                       noted: bool) -> None:
    """``model.double()`` between two calls of a BatchNorm in training: the next call finds its
    running statistics as float64, which the call left as float32 after updating them. The replay
    does not compare them with it, and says so (it was a MISMATCH, "recorded float64[4], replayed
    float32[4]"); also in a recording made before the recorder noted buffers written between calls
    (``noted`` False), where the dtype tells."""
    if not noted:
        monkeypatch.setattr(capture.Session, "_buffers_written", lambda self, module, buffers: [], raising=False)
    torch.manual_seed(0)
    norm = Norm()
    path = tmp_path / "run.zarr"
    dtype = torch.float32
    with recorder.record(path, model=norm, mode="full"):
        for i in range(3):
            if i == 2:
                norm.double()
                dtype = torch.float64
            norm(torch.randn(8, 4, dtype=dtype))
    rec = replayer.open(path)
    result = replayer.replay(rec, 1)
    assert result.match and {d.name for d in result.outputs} == {"output", "after:bn.num_batches_tracked"}, \
        [d.summary() for d in result.outputs]
    said = [w for w in result.warnings if w.startswith("not compared: bn.running_mean")]
    assert len(said) == 1 and "between this call and the next (step 2)" in said[0], result.warnings
    if not noted:
        assert "bn.running_mean (left float32[4] on cpu, found float64[4] on cpu)" in said[0]
    assert all(replayer.replay(rec, i).match for i in range(len(rec)))
    assert any(layout.BUFFERS_WRITTEN_NOTE in n for n in rec.step(2).extra.get("notes", [])) == noted


@recorder.paper_step("Eq. 5", description="Polyak averaging of the target, through .data")
def polyak_through_data(target: list[torch.Tensor], online: list[torch.Tensor], tau: float) -> None:
    for p_t, p in zip(target, online):
        p_t.data.mul_(tau).add_((1 - tau) * p.data)  # (.data: autograd's version counter does not move)


def test_writes_through_data_are_seen(tmp_path: Path) -> None:
    """Writes through ``.data`` do not bump autograd's version counters, by which the recorder saw
    in-place updates. A Polyak update of a target network written so was recorded as changing none of
    its inputs: nothing compared, and a NaN it wrote into the target was found "kept out of results"
    at the next step (bisect exit 0). A target encoder's BatchNorm buffers copied from the online
    one (``b_t.data.copy_(b.data)``, BYOL) made every replay of the target's calls a MISMATCH of
    its running statistics. Small CPU tensors are now also compared by their bits. And the
    last call of a module, whose buffer updates no later call recorded, says they were not compared."""
    torch.manual_seed(0)
    online, target = Norm(), Norm()
    target.load_state_dict(online.state_dict())
    target.requires_grad_(False)
    optimizer = torch.optim.SGD(online.parameters(), lr=0.1)
    path = tmp_path / "run.zarr"
    with recorder.record(path, model=online, optimizer=optimizer, modules="**", mode="full"):
        for i in range(4):
            x = torch.randn(8, 4)
            with torch.no_grad():
                target(x)
            (online(x) - 1).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            polyak_through_data(list(target.parameters()), list(online.parameters()), float("nan") if i == 2 else 0.9)
            for b_t, b in zip(target.buffers(), online.buffers()):
                b_t.data.copy_(b.data)
    rec = replayer.open(path)
    update = rec.step("Eq. 5@iter=1")  # (after the optimizer step that ends iteration 0)
    assert {r.name for r in update.records if r.role == "output"} == {"after:args.0.0", "after:args.0.1"}
    results = [replayer.replay(rec, s) for s in rec.steps if s.iteration < 3]  # (after the NaN: NaN stays NaN)
    assert all(r.match for r in results), [(r.step.index, [d.summary() for d in r.outputs if not d.match])
                                           for r in results if not r.match]
    origin = replayer.first_nonfinite(rec)  # (the NaN came in through tau, a float argument: no step made it)
    assert origin.entered is not None and (origin.entered.name, origin.entered.iteration) == ("polyak_through_data", 3)
    assert origin.cause.startswith("argument args.2 (float, 1 NaN) of step")
    last = replayer.replay(rec, [s for s in rec.steps if s.phase == "forward" and s.name == "Norm"][-1])
    assert any(w.startswith("not compared: bn.running_mean, bn.running_var, bn.num_batches_tracked, which the "
                            "call changed: no later call") for w in last.warnings), last.warnings


@recorder.paper_step("Eq. 21", description="a step the user stopped with Ctrl-C")
def interrupted(x: torch.Tensor, stop: bool) -> torch.Tensor:
    if stop:
        raise KeyboardInterrupt  # where a Ctrl-C or a notebook's interrupt lands
    return x * 3


def test_a_step_stopped_by_ctrl_c_is_not_a_mismatch(tmp_path: Path) -> None:
    """Ctrl-C (a kernel interrupt) lands inside a step: the step's recorded KeyboardInterrupt is not
    its outcome. A replay refuses it in one line, and `pdbg verify` lists it apart and exits 0 (it
    was a MISMATCH, "the replay returned normally", and verify failed the run)."""
    path = tmp_path / "run.zarr"
    with pytest.raises(KeyboardInterrupt), recorder.record(path, mode="full") as run:
        for i in range(3):
            interrupted(torch.randn(3), stop=i == 2)
            run.next_iteration()
    done = pdbg_here("verify", str(path), "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads(done.stdout)
    assert doc["matched"] == doc["replayed"] == 2 and doc["mismatches"] == []
    (stopped,) = doc["not_replayed"]
    assert stopped["step"]["iteration"] == 2 and "stopped from outside while it ran (KeyboardInterrupt" in \
        stopped["reason"]
    one = pdbg_here("replay", str(path), "Eq. 21@iter=2", cwd=tmp_path)
    assert one.returncode == 2 and one.stderr.count("\n") == 1 and "stopped from outside" in one.stderr


@recorder.paper_step("Eq. 21", description="negative log-likelihood under a unit normal")
def unit_nll(x: torch.Tensor) -> torch.Tensor:
    return -torch.distributions.Normal(torch.zeros_like(x), torch.ones_like(x)).log_prob(x).sum()


def test_distribution_validation_switched_off_while_recording_is_off_for_the_replay(tmp_path: Path) -> None:
    """torch.distributions.Distribution.set_default_validate_args(False) while recording (for speed, in a
    training script's main()): log_prob given a NaN returned NaN. A replay, in a process whose default
    validates, raised ValueError there: a MISMATCH, as if the step had raised. The default is a recorded
    setting, applied for the replay; the caller's comes back after."""
    D = torch.distributions.Distribution
    before = D._validate_args
    path = tmp_path / "run.zarr"
    try:
        D.set_default_validate_args(False)
        with recorder.record(path, mode="full"):
            unit_nll(torch.tensor([0.5, float("nan")]))
    finally:
        D.set_default_validate_args(True)
    rec = replayer.open(path)
    result = replayer.replay(rec, 0)
    assert result.match and result.exception is None and result.outputs[0].recorded["nan"] == 1, (
        result.exception, result.outputs)
    assert rec.step(0).settings["distributions_validate_args"] is False
    assert D._validate_args is True
    D.set_default_validate_args(before)


@recorder.paper_step("Eq. 22", description="a convolution")
class ConvStep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(16, 32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


def test_onednn_switched_off_while_recording_is_switched_off_for_the_replay(tmp_path: Path) -> None:
    """torch.backends.mkldnn.enabled = False (to avoid a oneDNN bug) while recording a convolution:
    the replay runs with it off too, bit for bit (it ran oneDNN's kernels: 36,000 elements differed
    with no reason given), and the caller's setting comes back after."""
    torch.manual_seed(0)
    conv = ConvStep()
    path = tmp_path / "run.zarr"
    try:
        torch.backends.mkldnn.enabled = False
        with recorder.record(path, model=conv, mode="full"):
            conv(torch.randn(4, 16, 20, 20)).pow(2).mean().backward()
    finally:
        torch.backends.mkldnn.enabled = True
    rec = replayer.open(path)
    assert rec.step(0).settings["mkldnn_enabled"] is False
    assert all(replayer.replay(rec, i).match for i in range(len(rec)))
    assert torch.backends.mkldnn.enabled


@recorder.paper_step("Eq. 24", description="a scale into float32's denormal range")
def tiny_scale(x: torch.Tensor, s: float) -> torch.Tensor:
    return x * s


def test_denormals_flushed_while_recording_are_flushed_for_the_replay(tmp_path: Path) -> None:
    """torch.set_flush_denormal(True) (or a library built with -ffast-math) while recording: the
    setting is recorded, and the replay, in a process that does not flush, flushes too, forward and
    backward bit for bit (its outputs were zeros where the replay made denormals: a MISMATCH with no
    reason given); the caller's setting comes back after."""
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals to zero")
    path = tmp_path / "run.zarr"
    x = torch.linspace(1, 2, 64, requires_grad=True)
    try:
        assert snapshot.flushes_denormals()
        with recorder.record(path, mode="full"):
            tiny_scale(x, 1e-39).sum().backward()
    finally:
        torch.set_flush_denormal(False)
    assert not snapshot.flushes_denormals()
    rec = replayer.open(path)
    assert rec.step(0).settings["flush_denormal"] is True
    assert not rec.step(0).tensor("output").any()  # flushed: zeros, where this process makes denormals
    assert (x.detach() * 1e-39).all()
    results = [replayer.replay(rec, i) for i in range(len(rec))]
    assert len(results) == 2 and all(r.match for r in results), [str(r) for r in results]
    assert not snapshot.flushes_denormals()


def _nudge(module: nn.Module, args: Any, out: Any) -> Any:
    return out + 0.01 if isinstance(module, nn.Linear) else None


def test_hooks_on_every_module_are_named_and_the_callers_own_left_out(tmp_path: Path) -> None:
    """A hook on every module's calls (register_module_forward_hook) while recording: a replay runs
    without it and says so (it was a MISMATCH with no reason given). The replaying process's own
    such hook, and its anomaly mode, do not reach the replay (a clean recording replayed as a
    MISMATCH, and anomaly mode raised inside its backward), and both are as they were after."""
    torch.manual_seed(0)
    critic = Critic()
    hook = torch.nn.modules.module.register_module_forward_hook(_nudge)
    try:
        with recorder.record(tmp_path / "hooked.zarr", model=critic, mode="full"):
            critic(torch.randn(8, 4)).pow(2).sum().backward()
    finally:
        hook.remove()
    res = replayer.replay(replayer.open(tmp_path / "hooked.zarr"), 0)
    assert any(w.startswith("global forward hook _nudge: hooks on every module's calls") and
               w.endswith("(a likely cause of any difference)") for w in res.warnings), res.warnings
    with recorder.record(tmp_path / "clean.zarr", model=critic, mode="full"):
        critic(torch.randn(8, 4)).pow(2).sum().backward()
    rec = replayer.open(tmp_path / "clean.zarr")
    hook = torch.nn.modules.module.register_module_forward_hook(_nudge)
    try:
        with torch.autograd.set_detect_anomaly(True, check_nan=True):
            assert [replayer.replay(rec, i).match for i in range(len(rec))] == [True] * len(rec)
            assert torch.is_anomaly_enabled() and torch.is_anomaly_check_nan_enabled()
        assert list(torch.nn.modules.module._global_forward_hooks.values()) == [_nudge]
    finally:
        hook.remove()


class _Doubled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


def _double_doubled(module: nn.Module, args: Any, out: Any) -> Any:
    return out * 2 if isinstance(module, _Doubled) else None


def test_a_global_forward_hook_set_before_the_recording_runs_after_a_glob_steps_end(tmp_path: Path) -> None:
    """A user's hook on every module's calls registered before the recording began, which doubles a module's output:
    the module's step, selected by modules=, ends with what its forward returned (as a decorated class's does), and
    replays bit for bit forward and backward (it recorded the hook's doubled output and its gradient: a MISMATCH of
    every call); training is as unrecorded, and the hook runs after the recording closed."""
    def train(path: Path | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), _Doubled(), nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with recorder.record(path, model=model, optimizer=opt, modules=["1"]) if path else contextlib.nullcontext():
            for _ in range(2):
                model(torch.randn(8, 4)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()] + [model(torch.ones(1, 4)).detach()]

    hook = torch.nn.modules.module.register_module_forward_hook(_double_doubled)
    try:
        plain, recorded = train(None), train(tmp_path / "doubled.zarr")
        assert list(torch.nn.modules.module._global_forward_hooks.values()) == [_double_doubled]
    finally:
        hook.remove()
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(plain, recorded))
    rec = replayer.open(tmp_path / "doubled.zarr")
    assert [s.phase for s in rec.steps] == ["forward", "backward"] * 2
    results = [replayer.replay(rec, i) for i in range(len(rec))]
    assert all(r.match for r in results), [str(r) for r in results]


@recorder.paper_step("Eq. 4")
class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


def _triple_grad(module: nn.Module, grad_out: Any) -> Any:
    return (grad_out[0] * 3,)


def test_a_steps_own_backward_pre_hook_is_no_warning(tmp_path: Path) -> None:
    """A step's own module's backward pre-hook ran on its grad outputs before the step recorded them: its backward
    replays bit for bit without it, and no warning calls it a likely cause of a difference (one did, on a MATCH)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), _Scaled(), nn.Linear(4, 1))
    model[1].register_full_backward_pre_hook(_triple_grad)
    with recorder.record(tmp_path / "pre.zarr", model=model):
        model(torch.randn(8, 4)).pow(2).mean().backward()
    rec = replayer.open(tmp_path / "pre.zarr")
    back = rec.steps.filter(phase="backward")[0]
    res = replayer.replay(rec, back.index)
    assert res.match, str(res)
    assert not any("_triple_grad" in w for w in res.warnings), res.warnings


class _GradScaled(_Doubled):
    """The same block, a class of its own for the backward hook's tests to pick out."""


def _double_grad_input(module: nn.Module, grad_in: Any, grad_out: Any) -> Any:
    return (grad_in[0] * 2,) if isinstance(module, _GradScaled) else None


def _trained_as_unrecorded(train: Any, path: Path, on_every_module: Any = None) -> replayer.Recording:
    """``train(None)`` and ``train(path)`` (unrecorded and recorded; each returns its losses, gradients and
    parameters), with ``on_every_module`` a full backward hook on every module's calls if given: asserts they
    are bitwise the same, and opens the recording."""
    hook = (torch.nn.modules.module.register_module_full_backward_hook(on_every_module) if on_every_module
            else contextlib.nullcontext())
    try:
        plain, recorded = train(None), train(path)
    finally:
        if on_every_module:
            hook.remove()
    assert len(plain) == len(recorded)
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(plain, recorded))
    return replayer.open(path)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
@pytest.mark.parametrize("where", ["own", "global"])
def test_a_glob_steps_full_backward_hook_that_changes_its_grad_input(tmp_path: Path, where: str) -> None:
    """A module selected by modules= whose full backward hook (its own, or one on every module's calls, registered
    before the recording) doubles its grad input: its backward step records the grad input its backward computed,
    as a decorated class's does, and replays bit for bit (it recorded the hook's doubled one: MISMATCH, max rel 0.5);
    training is as unrecorded."""
    def train(path: Path | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), _GradScaled(), nn.Linear(4, 1))
        if where == "own":
            model[1].register_full_backward_hook(_double_grad_input)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        out = []
        with recorder.record(path, model=model, optimizer=opt, modules=["1"]) if path else contextlib.nullcontext():
            for _ in range(2):
                loss = model(torch.randn(8, 4)).pow(2).mean()
                loss.backward()
                out += [loss.detach(), *(p.grad.clone() for p in model.parameters())]
                opt.step()
                opt.zero_grad()
        return out + [p.detach().clone() for p in model.parameters()]

    rec = _trained_as_unrecorded(train, tmp_path / "scaled.zarr", _double_grad_input if where == "global" else None)
    assert [s.phase for s in rec.steps] == ["forward", "backward"] * 2
    results = [replayer.replay(rec, i) for i in range(len(rec))]
    assert all(r.match for r in results), [str(r) for r in results]


@pytest.mark.parametrize("where", ["own", "global"])
def test_a_glob_steps_leaf_argument_gets_its_grad_from_before_the_full_backward_hook(tmp_path: Path,
                                                                                     where: str) -> None:
    """A leaf given to a module selected by modules= whose full backward hook (its own, or one on every module's
    calls) doubles its grad input: the leaf's grad input is the one the module's backward computed, from before
    the hook's node (it was the hook's doubled one: MISMATCH, max rel 0.5), and replays bit for bit; training,
    the leaf's own .grad included, is as unrecorded."""
    def train(path: Path | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(_GradScaled(), nn.Linear(4, 1))
        if where == "own":
            model[0].register_full_backward_hook(_double_grad_input)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        out = []
        with recorder.record(path, model=model, optimizer=opt, modules=["0"]) if path else contextlib.nullcontext():
            for _ in range(2):
                x = torch.randn(8, 4, requires_grad=True)
                loss = model[1](model[0](x)).pow(2).mean()  # (the global hook on model's call would wrap x)
                loss.backward()
                out += [loss.detach(), x.grad, *(p.grad.clone() for p in model.parameters())]
                opt.step()
                opt.zero_grad()
        return out + [p.detach().clone() for p in model.parameters()]

    rec = _trained_as_unrecorded(train, tmp_path / "leaf.zarr", _double_grad_input if where == "global" else None)
    backward = rec.steps.filter(phase="backward")
    assert len(backward) == 2 and all("args.0" in [t.name for t in s.tensors("grad_input")] for s in backward)
    results = [replayer.replay(rec, i) for i in range(len(rec))]
    assert all(r.match for r in results), [str(r) for r in results]


class _TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.g = nn.Linear(16, 16)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(a)) * self.g(b) + a * b.sin() + a.exp()


def _double_two_inputs(module: nn.Module, grad_in: Any, grad_out: Any) -> Any:
    return tuple(g * 2 for g in grad_in) if isinstance(module, _TwoInputs) else None


def _same_grad_outputs(module: nn.Module, grad_out: Any) -> Any:
    return None


def _given_twice_trained(path: Path | None, blk: Callable[[], nn.Module], leaf: bool,
                         modules: list[str] | None = None) -> list[torch.Tensor]:
    """Two iterations of ``post(blk(h, h) + h)``, h ``pre``'s output (or the input itself, a leaf), recorded into
    ``path`` when given (``modules=``, else the decorated steps): the losses, gradients and parameters."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"pre": nn.Linear(16, 16), "blk": blk(), "post": nn.Linear(16, 1)})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    selected = {} if modules is None else {"modules": modules}
    out = []
    with recorder.record(path, model=model, optimizer=opt, **selected) if path else contextlib.nullcontext():
        for _ in range(2):
            x = torch.randn(8, 16, requires_grad=leaf)
            h = x if leaf else model["pre"](x)
            loss = model["post"](model["blk"](h, h) + h).pow(2).mean()
            loss.backward()
            out += [loss.detach(), *(p.grad.clone() for p in model.parameters() if p.grad is not None)]
            out += [x.grad] if leaf else []
            opt.step()
            opt.zero_grad()
    return out + [p.detach().clone() for p in model.parameters()]


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
@pytest.mark.parametrize("leaf", [False, True], ids=["activation", "leaf"])
@pytest.mark.parametrize("where", ["own", "global", "pre-hook"])
def test_a_tensor_passed_twice_to_a_glob_step_with_a_full_backward_hook(tmp_path: Path, where: str,
                                                                         leaf: bool) -> None:
    """``blk(h, h)``, blk selected by modules= and with a full backward hook (or a backward pre-hook alone): torch
    gives each place an alias of its own through the hooks' node, so each place is recorded, tapped and followed
    apart, with a grad input of its own, and the backward replays bit for bit (the sum of the two was recorded
    under args.0: 4-16 ULP from the replay's one tensor, which adds its uses in another order); training, h's
    gradient included, is as unrecorded."""
    def blk() -> nn.Module:
        made = _TwoInputs()
        if where == "own":
            made.register_full_backward_hook(_double_two_inputs)
        elif where == "pre-hook":
            made.register_full_backward_pre_hook(_same_grad_outputs)
        return made

    def train(path: Path | None) -> list[torch.Tensor]:
        return _given_twice_trained(path, blk, leaf, modules=["blk"])

    rec = _trained_as_unrecorded(train, tmp_path / "twice.zarr", _double_two_inputs if where == "global" else None)
    assert [s.phase for s in rec.steps] == ["forward", "backward"] * 2
    for step in rec.steps:
        role = "input" if step.phase == "forward" else "grad_input"
        assert sorted(t.name for t in step.tensors(role)) == ["args.0", "args.1"]
    results = [replayer.replay(rec, i) for i in range(len(rec))]
    assert all(r.match for r in results), [str(r) for r in results]


class _CallsTwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(16, 16)
        self.blk = _TwoInputs()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre(x)
        return self.blk(h, h) + h


def _grads_as_they_are(module: nn.Module, grad_in: Any, grad_out: Any) -> Any:
    return None


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
@pytest.mark.parametrize(("where", "globs"), [("own", ["outer"]), ("own", ["outer", "outer.blk"]),
                                              ("pre-hook", ["outer", "outer.blk"]), ("global", ["outer"])])
def test_the_step_around_a_module_with_backward_hooks_given_a_tensor_twice(tmp_path: Path, where: str,
                                                                           globs: list[str]) -> None:
    """The step around ``blk(h, h)``, blk with a full backward hook or a backward pre-hook that leaves the gradients
    as they are: torch passes h through the hooks' node, an alias per place, whose gradients reach h one after the
    other; the replay, which cannot run the hooks, puts that node there again, and the step's backward replays bit
    for bit (it used h itself in blk: pre's gradient 2-64 ULP off), blk's own inner step too."""
    def train(path: Path | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.ModuleDict({"outer": _CallsTwoInputs(), "post": nn.Linear(16, 1)})
        if where == "own":
            model["outer"].blk.register_full_backward_hook(_grads_as_they_are)
        elif where == "pre-hook":
            model["outer"].blk.register_full_backward_pre_hook(_same_grad_outputs)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        out = []
        with recorder.record(path, model=model, optimizer=opt, modules=globs) if path else contextlib.nullcontext():
            for _ in range(2):
                loss = model["post"](model["outer"](torch.randn(8, 16))).pow(2).mean()
                loss.backward()
                out += [loss.detach(), *(p.grad.clone() for p in model.parameters())]
                opt.step()
                opt.zero_grad()
        return out + [p.detach().clone() for p in model.parameters()]

    rec = _trained_as_unrecorded(train, tmp_path / "around.zarr", _grads_as_they_are if where == "global" else None)
    assert {s.module_path for s in rec.steps} == set(globs)
    results = [replayer.replay(rec, i) for i in range(len(rec))]
    assert all(r.match for r in results), [str(r) for r in results]
    assert all(i.match for r in results for i in r.inner)


@recorder.paper_step("Eq. 2")
class _TwoInputsStep(_TwoInputs):
    pass


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
@pytest.mark.parametrize("leaf", [False, True], ids=["activation", "leaf"])
def test_a_decorated_class_with_a_full_backward_hook_given_a_tensor_twice(tmp_path: Path, leaf: bool) -> None:
    """``step(h, h)``, a decorated class with a full backward hook: torch gives its forward an alias of h per place,
    which share memory; each is tapped, its backward records each place's gradient, bitwise what the hook was given
    (it recorded none: the aliases were left untapped as tensors sharing memory), and replays bit for bit."""
    given: list[torch.Tensor] = []

    def keep(module: nn.Module, grad_in: Any, grad_out: Any) -> None:
        given.extend(g.clone() for g in grad_in)

    def blk() -> nn.Module:
        made = _TwoInputsStep()
        made.register_full_backward_hook(keep)
        return made

    def train(path: Path | None) -> list[torch.Tensor]:
        return _given_twice_trained(path, blk, leaf)

    rec = _trained_as_unrecorded(train, tmp_path / "twice.zarr")
    backward = [s for s in rec.steps if s.phase == "backward"]
    assert len(backward) == 2 and len(given) == 8  # (per place and pass; unrecorded, then recorded)
    for k, step in enumerate(backward):
        for i in range(2):
            got, want = step.tensor(f"args.{i}"), given[4 + 2 * k + i]
            assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    results = [replayer.replay(rec, i) for i in range(len(rec))]
    assert all(r.match for r in results), [str(r) for r in results]


class _KeywordInput(_TwoInputs):
    def forward(self, a: torch.Tensor, other: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(a, other)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
@pytest.mark.parametrize(("where", "leaf"), [("own", False), ("pre-hook", False), ("own", True)])
def test_a_tensor_passed_by_position_and_by_keyword_to_a_glob_step_with_backward_hooks(tmp_path: Path, where: str,
                                                                                       leaf: bool) -> None:
    """``blk(h, other=h)``, blk selected by modules= with backward hooks that leave the gradients as they are: torch
    passes only the positional h through the hooks' node; the grad input args.0 is the total over both places, the
    keyword's uses included (it was the positional place's alone, what came through the node: MISMATCH by up to
    2e9 ULP), and the backward replays bit for bit, through that node again (a leaf h: 4-6 ULP off without it);
    training is as unrecorded."""
    sums: list[torch.Tensor] = []

    def train(path: Path | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.ModuleDict({"pre": nn.Linear(16, 16), "blk": _KeywordInput(), "post": nn.Linear(16, 1)})
        if where == "own":
            model["blk"].register_full_backward_hook(_grads_as_they_are)
        else:
            model["blk"].register_full_backward_pre_hook(_same_grad_outputs)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        out = []
        with recorder.record(path, model=model, optimizer=opt, modules=["blk"]) if path else contextlib.nullcontext():
            for _ in range(2):
                h = torch.randn(8, 16, requires_grad=True) if leaf else model["pre"](torch.randn(8, 16))
                y = model["blk"](h, other=h)
                loss = model["post"](y + h).pow(2).mean()
                if path is None:
                    sums.append(torch.autograd.grad(loss, h, retain_graph=True)[0] - torch.autograd.grad(
                        loss, y, retain_graph=True)[0])  # (what came by blk, up to rounding)
                loss.backward()
                out += [loss.detach(), *(p.grad.clone() for p in model.parameters() if p.grad is not None)]
                out += [h.grad] if leaf else []
                opt.step()
                opt.zero_grad()
        return out + [p.detach().clone() for p in model.parameters()]

    rec = _trained_as_unrecorded(train, tmp_path / "keyword.zarr")
    backward = [s for s in rec.steps if s.phase == "backward"]
    assert [sorted(t.name for t in s.tensors("grad_input")) for s in backward] == [["args.0"]] * 2
    for step, near in zip(backward, sums):
        assert torch.allclose(step.tensor("args.0"), near, atol=1e-5)
    results = [replayer.replay(rec, i) for i in range(len(rec))]
    assert all(r.match for r in results), [str(r) for r in results]


def test_verify_says_once_why_many_steps_cannot_be_replayed(tmp_path: Path) -> None:
    """Many steps refused for one reason (code a notebook cell defined: every step alike) are one line
    of `pdbg verify`'s listing (it printed the reason once per step: 6,000 lines); --json keeps each."""
    path = tmp_path / "run.zarr"
    record_local_steps(path, 6)
    text = pdbg_here("verify", str(path), cwd=tmp_path)
    lines = text.stdout.splitlines()
    assert text.returncode == 2 and len(lines) == 3 and lines[1] == "could not be replayed:", text.stdout
    assert lines[2].startswith("  6 steps (step 0: ") and "... step 5: " in lines[2] and "<locals>" in lines[2]
    doc = json.loads(pdbg_here("verify", str(path), "--json", cwd=tmp_path).stdout)
    assert len(doc["not_replayed"]) == 6


def test_a_selector_that_matches_nothing_says_what_its_step_has(tmp_path: Path) -> None:
    """A step's name with a call, iteration or backward it does not have: the error says which calls
    or iterations the step has, or that the call has no backward (it listed the recording's names,
    the step's among them, as if the name were wrong)."""
    layer = Shared()
    with recorder.record(tmp_path / "run.zarr", model=layer) as run:
        for _ in range(2):
            h = layer(torch.randn(3, 4, requires_grad=True))
            layer(h.detach()).sum().backward()  # the first call's output is not used for the loss
            run.next_iteration()
    rec = replayer.open(tmp_path / "run.zarr")
    for selector, said in (("Eq. 4@iter=0#99", "Eq. 4@iter=0 has calls 0..1"),
                           ("Eq. 4@iter=7", "Eq. 4 has iterations 0..1"),
                           ("Eq. 4@iter=1#0:backward", "Eq. 4@iter=1#0 has no backward step (no backward pass"),
                           ("Eq. 5", "names in this recording: Shared; paper labels: Eq. 4")):
        with pytest.raises(StepNotFoundError) as raised:
            rec.step(selector)
        assert str(raised.value).startswith(f"no step matches {selector!r}; {said}"), str(raised.value)


@recorder.paper_step("Eq. 9", description="an EMA of the weights, every third iteration")
def every_third(x: torch.Tensor) -> torch.Tensor:
    return x * 0.9


def test_a_selectors_hint_lists_calls_and_iterations_that_have_gaps(tmp_path: Path) -> None:
    """A step with calls 1 and 3 of an iteration (or iterations 1 and 3) was said to have "calls 1..3"."""
    with recorder.record(tmp_path / "run.zarr") as run:
        for i in range(4):
            if i % 2:
                every_third(torch.ones(2))
            run.next_iteration()
    rec = replayer.open(tmp_path / "run.zarr")
    with pytest.raises(StepNotFoundError, match=r"; Eq. 9 has iterations 1, 3$"):
        rec.step("Eq. 9@iter=8")


@recorder.paper_step("Enc")
class Enc(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(4))

    def forward(self, o: torch.Tensor) -> torch.Tensor:
        return o + self.bias


def test_a_backward_is_selected_by_its_forward_call(tmp_path: Path) -> None:
    """A replay buffer keeps an encoder's outputs attached to their graph, and iteration 3's loss
    backpropagates through iteration 0's. That backward step ran in iteration 3, with its forward's
    call number 0: `Enc@iter=3#0:backward` named it (not the backward of Enc@iter=3#0, which did not
    run), and `Enc@iter=0#0:backward` was refused ("no backward pass reached it"). A backward is now
    selected by its forward call's iteration and call, as its selector writes it."""
    torch.manual_seed(0)
    enc, head = Enc(), nn.Linear(4, 1)
    optimizer = torch.optim.SGD([*enc.parameters(), *head.parameters()], lr=0.1)
    kept = []
    with recorder.record(tmp_path / "run.zarr", optimizer=optimizer):
        for i in range(4):
            kept.append(enc(torch.randn(4)))
            sample = torch.zeros(4) if i == 0 else kept[0] if i == 3 else kept[-1]
            head(sample).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    rec = replayer.open(tmp_path / "run.zarr")
    late = rec.step("Enc@iter=0#0:backward")
    assert (late.iteration, late.forward) == (3, rec.step("Enc@iter=0#0").index)
    assert late.selector == "Enc@iter=0#0:backward" and rec.step(late.selector).index == late.index
    with pytest.raises(StepNotFoundError, match="no backward pass reached it"):
        rec.step("Enc@iter=3#0:backward")
    assert replayer.replay(rec, late).match


def test_a_backward_selector_without_a_call_names_the_first_calls_backward(tmp_path: Path) -> None:
    """"Enc@iter=1:backward" named the first backward step in execution order, the last call's (#1),
    while "Enc@iter=1" names call #0: it names #0's backward, as the README says a selector's first
    match is."""
    enc = Enc()
    optimizer = torch.optim.SGD(enc.parameters(), lr=0.1)
    with recorder.record(tmp_path / "run.zarr", optimizer=optimizer):
        for _ in range(2):
            (enc(torch.randn(4)) * enc(torch.randn(4))).sum().backward()
            optimizer.step()
    rec = replayer.open(tmp_path / "run.zarr")
    picked = rec.step("Enc@iter=1:backward")
    assert picked.index == rec.step("Enc@iter=1#0:backward").index != rec.step("Enc@iter=1#1:backward").index
    assert picked.forward == rec.step("Enc@iter=1").index and picked.selector == "Enc@iter=1#0:backward"
    assert rec.step("Enc:backward").forward == rec.step("Enc").index == 0
    res = pdbg_here("replay", "run.zarr", "Enc@iter=1:backward", "--json", cwd=tmp_path)
    assert json.loads(res.stdout)["step"]["call"] == 0, res.stdout + res.stderr


def test_verify_says_which_backward_steps_lack_their_forward(tmp_path: Path) -> None:
    """Flight mode keeps the last iterations' tensors: a backward that ran in a kept iteration through
    a graph of an iteration let go (a replay buffer's tensor) keeps its own tensors, not its forward
    call's, and cannot be replayed. verify counted it as "kept statistics only", which it is not."""
    torch.manual_seed(0)
    enc, head = Enc(), nn.Linear(4, 1)
    optimizer = torch.optim.SGD([*enc.parameters(), *head.parameters()], lr=0.1)
    kept = []
    with recorder.record(tmp_path / "run.zarr", optimizer=optimizer, mode="flight", keep=1):
        for i in range(4):
            kept.append(enc(torch.randn(4)))
            head(kept[0] if i == 3 else kept[-1]).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    res = pdbg_here("verify", "run.zarr", "--json", cwd=tmp_path)
    doc = json.loads(res.stdout)
    assert (doc["replayed"], doc["statistics_only"], doc["forward_not_kept"]) == (1, 7, 1), doc
    res = pdbg_here("verify", "run.zarr", cwd=tmp_path)
    assert "7 steps kept statistics only, not replayable (1 of them backward steps that kept their own tensors, " \
           "not those of their forward call" in res.stdout, res.stdout


def test_verify_does_not_count_a_backward_that_needs_no_tensors_as_keeping_its_own(tmp_path: Path) -> None:
    """A second-order backward step (a gradient penalty's pass) has no grad output to keep: in a stats
    recording verify said it "kept its own tensors, not those of its forward call, from an iteration
    flight mode had let go", of a run with no flight mode that kept no tensors."""
    torch.manual_seed(0)
    critic = Critic()
    with recorder.record(tmp_path / "run.zarr", model=critic, mode="stats"):
        for _ in range(2):
            x = torch.randn(8, 4, requires_grad=True)
            (g,) = torch.autograd.grad(critic(x).sum(), x, create_graph=True)
            (g.norm(dim=1) - 1).pow(2).mean().backward()  # no grad output: second order only
    res = pdbg_here("verify", "run.zarr", "--json", cwd=tmp_path)
    doc = json.loads(res.stdout or "{}")
    assert doc.get("statistics_only") == 6 and "forward_not_kept" not in doc, res.stdout + res.stderr
    res = pdbg_here("verify", "run.zarr", cwd=tmp_path)
    assert "6 steps kept statistics only, not replayable\n" in res.stdout and "flight" not in res.stdout, res.stdout


def test_selectors_of_evaluations_sparse_steps_and_the_root(tmp_path: Path) -> None:
    """An iteration inside a sparse step's span was answered "has iterations 3..9", as if it had it;
    a no-grad evaluation call's backward was said to be unused by the loss; ``.`` (the root module)
    also named function steps called outside every module, in selectors and in breakpoints. A
    selector that names no step is an error of ``find`` too (it printed "no step matches", exit 1)."""
    layer = Shared()
    root = recorder.breakpoint(".")
    try:
        with recorder.record(tmp_path / "run.zarr", model=layer) as run:
            for i in range(10):
                every_third(torch.ones(2)) if i % 3 == 0 and i else None
                with torch.no_grad():
                    layer(torch.randn(3, 4))  # an evaluation batch
                layer(torch.randn(3, 4)).sum().backward()
                run.next_iteration()
    finally:
        root.remove()  # (breakpoints outlive a recording: the tests after this one must not have it)
    rec = replayer.open(tmp_path / "run.zarr")
    for selector, said in (("Eq. 9@iter=5", "Eq. 9 has 3 iterations (3, 6, 9); the nearest to 5: 3 and 6"),
                           ("Eq. 9@iter=12", "Eq. 9 has 3 iterations (3, 6, 9); the nearest to 12: 9"),
                           ("Eq. 4@iter=2#0:backward", "Eq. 4@iter=2#0 has no backward step: it ran with gradients "
                                                       "off (torch.no_grad or inference_mode: an evaluation)")):
        for ask in (rec.step, lambda s: replayer.find(rec, s, None)):
            with pytest.raises(StepNotFoundError) as raised:
                ask(selector)
            assert str(raised.value) == f"no step matches {selector!r}; {said}", str(raised.value)
    assert rec.step("Eq. 4@iter=2#1:backward").forward == rec.step("Eq. 4@iter=2#1").index
    # the evaluation call is told apart from the training one wherever a step is named (find, replay, info)
    for command in ("find", "replay"):
        said = pdbg_here(command, str(tmp_path / "run.zarr"), "Eq. 4@iter=2#0", cwd=tmp_path).stdout
        assert "(Shared), forward (no grad), iteration 2, call 0" in said, said
    said = pdbg_here("find", str(tmp_path / "run.zarr"), "Eq. 4@iter=2#1", cwd=tmp_path).stdout
    assert "(Shared), forward, iteration 2, call 1" in said, said
    assert {s.name for s in rec.steps.select(".")} == {"Shared"} and rec.step(".").name == "Shared"
    assert {s.name for s in rec.steps if s.extra.get("alerts")} == {"Shared"} and root.hits == 20


def test_a_path_s_call_numbers_are_said_to_be_counted_among_its_class_s(tmp_path: Path) -> None:
    """Two Sequential modules recorded by path: `body@iter=0#0` was refused with "body@iter=0 has only call 1"
    and no word of why (a step's calls are numbered across every module of its class, as they ran)."""
    model = nn.ModuleDict({"t_mlp": nn.Sequential(nn.Linear(2, 2)), "body": nn.Sequential(nn.Linear(2, 2))})
    with recorder.record(tmp_path / "run.zarr", model=model, modules=["t_mlp", "body"]):
        model["body"](model["t_mlp"](torch.ones(1, 2)))
    rec = replayer.open(tmp_path / "run.zarr")
    assert rec.step("body@iter=0#1").module_path == "body"
    with pytest.raises(StepNotFoundError) as raised:
        rec.step("body@iter=0#0")
    assert str(raised.value) == ("no step matches 'body@iter=0#0'; body@iter=0 has only call 1 (calls are counted per "
                                 "step, Sequential, across every module of it in the order they ran: 1 ran before "
                                 "body's first call in that iteration)"), str(raised.value)


def test_a_frozen_layer_s_missing_backward_is_said_to_be_frozen(tmp_path: Path) -> None:
    """A frozen encoder (requires_grad=False) under a trained head has no backward step: asked for it,
    the answer blamed an output "not used for the loss, or detached", a detach bug to look for. Its
    outputs needed no gradient, which the records show, and the answer says so."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].requires_grad_(False)
    opt = torch.optim.SGD(model[1].parameters(), lr=0.1)
    with recorder.record(tmp_path / "run.zarr", model=model, modules=["0", "1"], optimizer=opt):
        for _ in range(2):
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    rec = replayer.open(tmp_path / "run.zarr")
    assert rec.step("1@iter=1:backward").forward == rec.step("1@iter=1").index  # the head's is there
    with pytest.raises(StepNotFoundError) as raised:
        rec.step("0@iter=1:backward")
    assert str(raised.value) == ("no step matches '0@iter=1:backward'; 0@iter=1 has no backward step: its outputs "
                                 "needed no gradient (its parameters are frozen, requires_grad=False, and its inputs "
                                 "need none either, so no backward pass runs through it)"), str(raised.value)


@recorder.paper_step("Eq. 24", description="a block with batch statistics")
class NormBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn = nn.Linear(8, 8), nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.fc(x)))


class NormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block, self.out = NormBlock(), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(x))


def test_a_teachers_buffers_are_not_compared_with_its_students(tmp_path: Path) -> None:
    """A student and a teacher of one class (both at path `block`), both in train mode: each call's
    running statistics are compared with its own module's next call, not the other's (verify
    failed 4 of 9 steps: the student's buffers against the teacher's and back)."""
    torch.manual_seed(0)
    student, teacher = NormNet(), NormNet()
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    path = tmp_path / "run.zarr"
    with recorder.record(path, model=student, optimizer=opt, mode="full"):
        for _ in range(3):
            x = torch.randn(16, 8)
            with torch.no_grad():
                target = teacher(x)  # its batch norm updates its own statistics
            (student(x) - target).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    done = pdbg_here("verify", str(path), "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stdout
    doc = json.loads(done.stdout)
    assert doc["matched"] == doc["replayed"] == 9 and doc["mismatches"] == [], doc
    rec = replayer.open(path)
    first = replayer.replay(rec, "Eq. 24@iter=0#1")  # the student's first call: compared with its next one
    assert "after:bn.running_mean" in first.diffs and first.match


def _double(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return (args[0] * 2,)


def test_verify_of_a_module_whose_own_pre_hook_changes_its_input(tmp_path: Path) -> None:
    """A module recorded through `modules=` with a forward pre-hook of its own that changes its
    input: its input is recorded as the hook left it (the recorder's hook runs last), so the replay
    (without the hook) matches, forward and backward, with no word of the hook. Where the hook ran
    after the capture (registered while recording), `pdbg verify` names it with the difference."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    model[0].register_forward_pre_hook(_double)
    path = tmp_path / "run.zarr"
    with recorder.record(path, model=model, mode="full", modules=["0"]):
        model(torch.randn(3, 4)).sum().backward()
        model[0].register_forward_pre_hook(_double)
        model(torch.randn(3, 4)).sum().backward()
    doc = json.loads(pdbg_here("verify", str(path), "--json", cwd=tmp_path).stdout)
    assert doc["replayed"] == 4 and doc["matched"] == 2, doc
    assert [m["step"]["index"] for m in doc["mismatches"]] == [2, 3], doc["mismatches"]
    assert all(f"_double: {layout.UNRUN_PRE_HOOKS_NOTE} (a likely cause of any difference)" in m["reason"]
               for m in doc["mismatches"]), doc["mismatches"]


@recorder.paper_step("Algorithm 2", description="one denoising step, given the network")
def denoise(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x - 0.1 * net(x)


class _Handle:
    """Not data (slots, one holding a lock), with a repr of several lines."""

    __slots__ = ("lock",)

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def __repr__(self) -> str:
        return "_Handle(\n  lock=held\n  state=open\n)"


@recorder.paper_step("Algorithm 2", description="one denoising step, given a handle")
def denoise_with(handle: _Handle, x: torch.Tensor) -> torch.Tensor:
    return x - 0.1 * x.tanh()


def test_a_step_given_a_module_replays_and_one_given_no_data_is_refused_in_one_line(tmp_path: Path) -> None:
    """A sampler's step given the network as an argument replays bit for bit (schema 1.30: the module is
    rebuilt from its skeleton; it was refused). A step given a value that is not data is refused, its repr
    quoted on one line (the repr's own lines broke the message over five)."""
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    path = tmp_path / "run.zarr"
    with recorder.record(path, mode="full"):
        denoise(net, torch.randn(2, 4))
    done = pdbg_here("replay", str(path), "0", cwd=tmp_path)
    assert done.returncode == 0 and "MATCH: bit for bit" in done.stdout, done.stdout + done.stderr
    path = tmp_path / "handle.zarr"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", recorder.RecorderWarning)
        with recorder.record(path, mode="full"):
            denoise_with(_Handle(), torch.randn(2, 4))
    done = pdbg_here("replay", str(path), "0", cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "_Handle( lock=held state=open )" in done.stderr, done.stderr


class TwiceInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(self.lin(x)))


def test_a_blocks_backward_with_an_inner_step_called_twice_matches(tmp_path: Path) -> None:
    """A block step whose inner module step runs twice in one call: each inner backward step holds its
    own call's share of the inner parameters' gradient, and is compared with the share its replayed
    call sends (each share was once compared with the total over both calls, a MISMATCH, then left
    out); and with a retained graph's second pass, each pass's inner steps are its own (the first
    pass's were taken)."""
    torch.manual_seed(0)
    model = nn.Sequential(TwiceInside(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "run.zarr"
    with recorder.record(path, model=model, optimizer=opt, mode="full", modules=["0", "0.lin"]):
        for _ in range(2):
            loss = model(torch.randn(3, 4, requires_grad=True)).pow(2).mean()
            loss.backward(retain_graph=True)
            (loss * 0.5).backward()
            opt.step()
            opt.zero_grad()
    rec = replayer.open(path)
    blocks = [s for s in rec.steps if s.module_path == "0" and s.phase == "backward"]
    assert len(blocks) == 4
    for block in blocks:
        res = replayer.replay(rec, block.index)
        assert res.match and len(res.inner) == 2 and all(s.match for s in res.inner), \
            (block.index, [(s.step.index, s.reason, [d.summary() for d in s.diffs if not d.match]) for s in res.inner])
        assert all({d.role for d in s.diffs} == {"grad_output", "grad_input", "param_grad"} for s in res.inner)


def test_a_name_set_again_after_a_failed_definition_is_defined(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """An unguarded script's definition that fails when loaded, and a later one setting the same
    name: the name is defined, and not said to be missing."""
    from replayer.code import script_module

    (tmp_path / "train.py").write_text("import sys\nout = sys.argv[3]\nout = 'fixed'\nlate = out + '!'\n")
    monkeypatch.setattr(sys, "argv", ["repro.py"])
    module, note, skipped = script_module(tmp_path / "train.py")
    assert module.out == "fixed" and module.late == "fixed!" and "out" not in skipped, (note, skipped)


smooth_lambda = recorder.paper_step("Eq. 13", name="smooth_lambda", description="softplus as a lambda")(
    lambda x: torch.log1p(torch.exp(x)))


@recorder.paper_step("Step 5", algorithm="Algorithm 1", step=5, equation="Eq. 7", description="the update")
def update_rule(x: torch.Tensor) -> torch.Tensor:
    return x * 0.5


@recorder.paper_step("Algorithm 2", step=1, description="first of two steps sharing the label")
def first_half(x: torch.Tensor) -> torch.Tensor:
    return x + 1


@recorder.paper_step("Algorithm 2", step=2, description="second of two steps sharing the label")
def second_half(x: torch.Tensor) -> torch.Tensor:
    return x - 1


@recorder.paper_step("Algorithm 1", description="the whole algorithm, labelled so")
def whole_algorithm(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_a_selector_names_what_it_named_before_other_references_matched(tmp_path: Path) -> None:
    """A step labelled "Algorithm 1" after one given algorithm="Algorithm 1": the label's step, as
    before steps were selectable by their algorithm (the first match was the other step)."""
    from replayer.recording import paper_reference

    path = tmp_path / "run.zarr"
    with recorder.record(path):
        whole_algorithm(update_rule(torch.randn(3)))
    rec = replayer.open(path)
    assert rec.step("Algorithm 1").name == rec.step("Algorithm 1@iter=0").name == "whole_algorithm"
    assert rec.step("Eq. 7").name == "update_rule"
    # the parts of a reference are matched whole: "Eq. 11" does not say algorithm 1, nor "Eq. 12" Eq. 1
    assert paper_reference({"label": "Eq. 11", "algorithm": 1, "step": 4}) == "Algorithm 1, Eq. 11, step 4"
    assert paper_reference({"label": "Eq. 2", "algorithm": 2}) == "Algorithm 2, Eq. 2"
    assert paper_reference({"label": "Eq. 12", "equation": "Eq. 1"}) == "Eq. 12 (Eq. 1)"
    assert paper_reference({"label": "Algorithm 1", "algorithm": 1, "step": 5}) == "Algorithm 1, step 5"


def test_a_module_level_lambda_is_named_as_a_lambda(tmp_path: Path) -> None:
    """It was said to be "defined inside a function", which it is not."""
    path = tmp_path / "run.zarr"
    with recorder.record(path):
        smooth_lambda(torch.randn(3))
    with pytest.raises(ReplayError, match=r"<lambda> \(in tests\.replayer\.test_replay\) is a lambda, which has no "
                                          r"name to be found again by; define it with def at module level"):
        replayer.replay(path, 0)


def test_paper_references_are_written_and_selected_as_the_paper_gives_them(tmp_path: Path) -> None:
    """paper_step("Step 5", algorithm="Algorithm 1", step=5, equation="Eq. 7") was listed as "Step 5
    step 5 (Eq. 7)" (its algorithm nowhere); a step could not be selected by its equation or by the
    reference listings show; a call number past a label's own steps was "has only call 0"."""

    path = tmp_path / "run.zarr"
    with recorder.record(path):
        x = torch.randn(3)
        update_rule(second_half(first_half(x)))
    rec = replayer.open(path)
    assert repr(rec.step("update_rule")).startswith("<Step 2: Algorithm 1, Step 5 (Eq. 7) (update_rule) forward")
    for selector in ("Eq. 7", "Algorithm 1", "Algorithm 1, Step 5", "Algorithm 1, Step 5 (Eq. 7)", "Step 5@iter=0"):
        assert rec.step(selector).name == "update_rule", selector
    assert [s.name for s in rec.steps.select("Algorithm 2")] == ["first_half", "second_half"]
    with pytest.raises(StepNotFoundError, match=r"Algorithm 2@iter=0 names 2 steps \(first_half, second_half\), each "
                                                r"counting its own calls \(calls 0 here\); select one by its name, "
                                                r"e\.g\. first_half@iter=0#0"):
        rec.step("Algorithm 2@iter=0#1")
    info = pdbg_here("info", str(path), cwd=tmp_path).stdout
    assert "Algorithm 1, Step 5 (Eq. 7)" in info and "Algorithm 2, step 1" in info, info
    found = pdbg_here("find", str(path), "Eq. 7", cwd=tmp_path)
    assert found.returncode == 0 and "update_rule" in found.stdout, found.stdout + found.stderr


TEMPERATURE = 1.0  # annealed by the loop below: a module-level value a step reads


@recorder.paper_step("Eq. 5", description="linear warm-up, its call count kept in a mutable default")
def warm_up(x: torch.Tensor, state: dict = {"t": 0}) -> torch.Tensor:  # noqa: B006 - the idiom under test
    state["t"] += 1
    return x * min(1.0, state["t"] / 10)


@recorder.paper_step("Eq. 3", description="softmax at the annealed temperature")
def tempered(x: torch.Tensor) -> torch.Tensor:
    return (x / TEMPERATURE).softmax(-1)


def test_state_a_step_keeps_outside_its_arguments(tmp_path: Path) -> None:
    """A mutable default is recorded as the call's argument, as it was when the call began: its
    replay matched or not depending on which replays ran before it in the process (pdbg verify
    matched, verify --sample did not). A module-level value training changes is not recorded:
    the mismatch names it as the likely cause."""
    global TEMPERATURE  # noqa: PLW0603 - the module-level value the step reads, as training code changes it
    path = tmp_path / "run.zarr"
    try:
        with recorder.record(path) as run:
            for _ in range(4):
                x = torch.randn(3, 5)
                warm_up(x)
                tempered(x)
                TEMPERATURE *= 0.5
                run.next_iteration()
    finally:
        TEMPERATURE = 1.0
    rec = replayer.open(path)
    assert rec.step("warm_up@iter=2").arguments["kwargs"]["state"] == {"t": 2}
    for order in ((3, 0, 2, 1), (1, 1, 3)):
        rep = Replayer(rec)
        assert all(rep.replay(f"warm_up@iter={i}").match for i in order), order
    later = replayer.replay(rec, "tempered@iter=2")
    assert not later.match and any(w.startswith("the step's code reads the module-level TEMPERATURE (float), whose "
                                                "values are not recorded") for w in later.warnings), later.warnings
    assert not any("module-level" in w for w in replayer.replay(rec, "warm_up@iter=1").warnings)
    # an intervention's mismatch is what it made: the step's constants are not named as a likely cause of it
    edited = replayer.replay(rec, "tempered@iter=2", edit={"args.0": "x * 2"})
    assert not edited.match and not any("likely cause" in w for w in edited.warnings), edited.warnings


LATE_SCALE: float | None = None  # set by the training code as it runs (a script's main()), None when loaded


@recorder.paper_step("Eq. 3b", description="scaled by a module-level value set as training starts")
def late_scaled(x: torch.Tensor) -> torch.Tensor:
    return x / LATE_SCALE


def test_a_replay_raising_on_a_module_level_name_none_when_loaded_names_it(tmp_path: Path) -> None:
    """A module-level name that is None when the code is loaded and set as training starts (a model or a
    temperature main() fills in): the replay raised, and named no module-level data, where a value set at load
    was named. Its warning names the name, as None when the code is loaded, and says why."""
    global LATE_SCALE  # noqa: PLW0603 - set as a script's main() sets it
    try:
        LATE_SCALE = 0.5
        with recorder.record(tmp_path / "run.zarr"):
            late_scaled(torch.ones(3))
    finally:
        LATE_SCALE = None
    result = replayer.replay(replayer.open(tmp_path / "run.zarr"), "late_scaled")
    assert not result.match and result.exception is not None and result.exception.startswith("TypeError")
    assert any(w.startswith("the step's code reads the module-level LATE_SCALE (None when the code is loaded), "
                            "whose values are not recorded") and "main()" in w
               for w in result.warnings), result.warnings


SCHEDULE_SCRIPT = """
import sys
import numpy as np
import torch
import recorder

BETAS = np.linspace(1e-4, 0.02, 10)


def alpha_bar(t):
    return float(np.cumprod(1 - BETAS)[t])


@recorder.paper_step("Algorithm 1, line 5", description="q_sample")
def q_sample(x, t):
    return x * alpha_bar(t) ** 0.5


if __name__ == "__main__":
    with recorder.record(sys.argv[1]):
        q_sample(torch.ones(4), 7)
"""


def test_a_function_step_whose_file_changed_since_recording_says_so(tmp_path: Path) -> None:
    """A noise schedule edited after the recording (a module-level array the step reads through a helper):
    a function step's replay was a MISMATCH with no word of why (only a module step's file was checked;
    the step's own body, hashed, had not changed). Its file is named, as a module step's is."""
    script = tmp_path / "train.py"
    script.write_text(SCHEDULE_SCRIPT)
    assert python("train.py", "run.zarr", cwd=tmp_path).returncode == 0
    script.write_text(SCHEDULE_SCRIPT.replace("0.02, 10", "0.04, 10"))
    os.utime(script, (time.time() + 5, time.time() + 5))  # (a second's clock on some file systems)
    doc = json.loads(pdbg_here("replay", "run.zarr", "0", "--json", cwd=tmp_path).stdout)
    assert not doc["match"]
    assert any(w.startswith(f"{script} was modified after the recording began, and the step's function q_sample is "
                            "defined there") for w in doc["warnings"]), doc["warnings"]


class Vae:
    """A model object that is no module and that the recorder cannot take apart (slots, one holding a lock)."""

    __slots__ = ("enc", "lock")

    def __init__(self) -> None:
        self.enc = nn.Linear(8, 4)
        self.lock = threading.Lock()

    @recorder.paper_step("Eq. 10", description="reparameterization, a method of the model object")
    def reparameterize(self, mu: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
        return mu + (0.5 * logvar).exp()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.reparameterize(*self.enc(x).chunk(2, 1))


class ModuleVae(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(8, 4)

    @recorder.paper_step("Eq. 10", description="reparameterization, a method of the module")
    def reparameterize(self, mu: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
        return mu + (0.5 * logvar * self.enc.bias[:2]).exp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reparameterize(*self.enc(x).chunk(2, 1))


class Ops:
    @staticmethod
    @recorder.paper_step("Eq. 27", description="a staticmethod step applying a function it is given")
    def apply(fn: Any, x: torch.Tensor) -> torch.Tensor:
        return fn(x)


def test_a_step_on_a_modules_other_method_replays(tmp_path: Path) -> None:
    """A module's other method decorated as a step (its self the module, reading its parameters): the module
    is rebuilt from its skeleton (schema 1.30), and every step, forward and backward, replays bit for bit
    (it was refused: its self was not data)."""
    path = tmp_path / "run.zarr"
    with recorder.record(path):
        ModuleVae()(torch.randn(3, 8)).sum().backward()
    rec = replayer.open(path)
    assert [s.phase for s in rec.steps] == ["forward", "backward"]
    for step in rec.steps:
        result = replayer.replay(rec, step.index)
        assert result.match, [d.summary() for d in result.outputs]


def test_a_step_on_an_objects_other_method_names_its_self_as_what_cannot_be_replayed(tmp_path: Path) -> None:
    """The refusal said the step "was called with a ...Vae (...)", not that the value is the method's
    self, nor what to do."""
    path = tmp_path / "run.zarr"
    with recorder.record(path):
        Vae()(torch.randn(3, 8))
    refusal = (r"step 0 \(Vae\.reparameterize\) is the method Vae\.reparameterize, and its self was a "
               r"tests\.replayer\.test_replay:Vae .*: a replay cannot rebuild the object a method belongs to .*make "
               r"the step a function of its tensors")
    with pytest.raises(ReplayError, match=refusal):
        replayer.replay(path, 0)
    # a staticmethod given a value that is not data is told that, not that its self was one
    with recorder.record(tmp_path / "static.zarr"):
        Ops.apply(lambda t: t * 2, torch.randn(3))
    with pytest.raises(ReplayError, match=r"step 0 \(Ops\.apply\) was called with the lambda tests\.replayer\."
                                          r"test_replay:test_a_step_on_an_objects_other_method_names_its_self_as_what_"
                                          r"cannot_be_replayed\.<locals>\.<lambda>, which could not be recorded"):
        replayer.replay(tmp_path / "static.zarr", 0)


def test_verify_lists_a_reason_that_names_each_step_once(tmp_path: Path) -> None:
    """A refusal whose text names the step's number (a module's helper method: every call says "step N
    (Vae.reparameterize) is the method ...") was listed once per step by `pdbg verify`, six long lines,
    and its error counted "2 other reasons" where there was one. The reason is listed once, with the
    steps it applies to."""
    path = tmp_path / "run.zarr"
    vae = Vae()
    with recorder.record(path) as run:
        for _ in range(3):
            vae(torch.randn(3, 8)).sum().backward()
            run.next_iteration()
    text = pdbg_here("verify", str(path), cwd=tmp_path)
    lines = text.stdout.splitlines()
    assert text.returncode == 2 and len(lines) == 3 and lines[1] == "could not be replayed:", text.stdout
    assert lines[2].startswith("  steps 0-5 (Eq. 10 (Vae.reparameterize)): step N (Vae.reparameterize) is the method "
                               "Vae.reparameterize, and its self was a tests.replayer.test_replay:Vae "), lines[2]
    assert lines[2].endswith(" (step N: each listed step's own number, or its forward's)"), lines[2]
    assert "step 0 (Vae.reparameterize) is the method" in text.stderr and "other reason" not in text.stderr
    doc = json.loads(pdbg_here("verify", str(path), "--json", cwd=tmp_path).stdout)
    assert [m["reason"].split(" (Vae")[0] for m in doc["not_replayed"]] == [
        "step 0", "step 0", "step 2", "step 2", "step 4", "step 4"]  # (a backward step's names its forward)


class Scaled:
    SCALE = 3.0

    @recorder.paper_step("Eq. 28", description="a staticmethod step, paper_step above @staticmethod")
    @staticmethod
    def unit(h: torch.Tensor) -> torch.Tensor:
        return h / h.norm()

    @recorder.paper_step("Eq. 29", description="a classmethod step, paper_step above @classmethod")
    @classmethod
    def scaled(cls, h: torch.Tensor) -> torch.Tensor:
        return h * cls.SCALE

    def both(self, h: torch.Tensor) -> torch.Tensor:
        return self.scaled(self.unit(h))


def test_paper_step_above_staticmethod_and_classmethod_binds_as_that_method(tmp_path: Path) -> None:
    """@paper_step above @staticmethod (the order one writes them, and what a module helper method's
    refusal advises) made a plain function of it: called through an instance it was given the instance
    too (TypeError: takes 1 positional argument but 2 were given), recording or not. Above @staticmethod
    and @classmethod it binds as the method it decorates, and records and replays as in the other order."""
    h = torch.randn(5)
    expected = h / h.norm() * 3.0
    assert isinstance(Scaled.__dict__["unit"], staticmethod) and isinstance(Scaled.__dict__["scaled"], classmethod)
    assert bits_equal(Scaled().both(h), expected) and bits_equal(Scaled.scaled(Scaled.unit(h)), expected)
    path = tmp_path / "run.zarr"
    w = nn.Parameter(h.clone())
    with recorder.record(path):
        (Scaled().both(w) + Scaled.scaled(Scaled.unit(w))).sum().backward()
    rec = replayer.open(path)
    assert sorted((rec.step(i).name, rec.step(i).phase) for i in range(len(rec))) == sorted(
        (name, phase) for name in ("Scaled.unit", "Scaled.scaled") for phase in ("forward", "backward") for _ in "ab")
    results = [replayer.replay(rec, i) for i in range(len(rec))]
    assert all(r.match and r.compared for r in results), [(r.step.index, r.warnings) for r in results]


def test_a_step_whose_work_runs_after_it_returns_is_said_when_recording_and_never_a_match(tmp_path: Path) -> None:
    """A generator behind a decorator of the user's (functools.wraps), a returned generator expression, a
    coroutine function behind such a decorator, and a module whose forward yields through one: their body
    ran after the call had returned, as the caller iterated or awaited it, outside the step. Their replay
    compared only the generator's type, "MATCH: bit for bit" (verify counted them verified), and an async
    step's replay leaked "coroutine 'transform' was never awaited". Recording says so once per step; every
    replay of them, forward and backward, is refused in one line, before the code runs."""
    import asyncio
    import gc
    import warnings

    from tests.replayer import kinds

    path = tmp_path / "run.zarr"
    w = nn.Parameter(torch.randn(4, 4) * 0.3)
    refiner = kinds.Refiner()
    with warnings.catch_warnings(record=True) as caught, recorder.record(path) as run:
        warnings.simplefilter("always")
        for _ in range(2):
            states = list(kinds.refine(torch.randn(8, 4), w, 2))
            features = torch.cat(list(kinds.chunks(states[-1])), -1)
            out = list(refiner(asyncio.run(kinds.transform(features))))[-1]
            out.pow(2).mean().backward()
            run.next_iteration()
    said = [str(c.message) for c in caught if issubclass(c.category, capture.RecorderWarning)]
    kinds_of = {"refine": "a generator", "chunks": "a generator", "transform": "a coroutine", "Refiner": "a generator"}
    labels = {"refine": "Algorithm 3", "chunks": "Eq. 11", "transform": "Eq. 12", "Refiner": "Algorithm 4"}
    assert sorted(said) == sorted(
        f"PaperDebugger: step {name} ({labels[name]}) returned {kind}, whose work runs after the call has returned "
        "(as the caller iterates or awaits it), outside the step: the recording holds none of that work, and a replay "
        "of the step is refused; make the step compute its values and return them (a tensor, a list)"
        for name, kind in kinds_of.items()), said
    rec = replayer.open(path)
    forwards = 0
    with warnings.catch_warnings(record=True) as leaked:
        warnings.simplefilter("always")
        for i in range(len(rec)):
            step = rec.step(i)
            did = (f"returned {kinds_of[step.name]}, whose work ran after the call had returned, as its caller "
                   "iterated or awaited it: ")
            if step.phase == "forward":
                forwards += 1
                expected = re.escape(f"step {i} ({step.name}) {did}outside the step, which recorded none of it; "
                                     "make the step compute its values and return them (a tensor, a list) to replay it")
            else:
                expected = re.escape(f"backward step {i}: its forward (step {step.forward}, {step.name}) {did}the "
                                     "gradients recorded here went through that work, outside the step; ")
            with pytest.raises(ReplayError, match=f"^{expected}"):
                replayer.replay(rec, i)
        gc.collect()
    assert forwards == 8 and len(rec) > forwards
    assert not [str(c.message) for c in leaked if issubclass(c.category, RuntimeWarning)]
    doc = json.loads(pdbg_here("verify", str(path), "--json", cwd=tmp_path).stdout)
    assert doc["replayed"] == doc["matched"] == 0 and len(doc["not_replayed"]) == len(rec)
    assert known_refusal(rec.step(0)).startswith("step 0 (refine) returned a generator")


def test_a_step_wrapped_by_a_decorator_without_functools_wraps_says_what_is_true(tmp_path: Path) -> None:
    """A decorator of the user's without functools.wraps, outside paper_step: the replay said the name is
    "not a paper step ... now", as if the code had changed. Inside it: the step was named
    "twice_nowraps.<locals>.wrapper", and the refusal said to define it at module level, which it is. Neither,
    nor a lambda step, was warned of. Recording says what is true, once per step, and so does the replay."""
    import warnings

    from tests.replayer import kinds

    path = tmp_path / "run.zarr"
    with warnings.catch_warnings(record=True) as caught, recorder.record(path) as run:
        warnings.simplefilter("always")
        for _ in range(2):
            x = torch.randn(3, 4)
            kinds.unit_outside(x), kinds.unit_inside(x), kinds.unit_lambda(x)
            run.next_iteration()
    said = [str(c.message) for c in caught if issubclass(c.category, capture.RecorderWarning)]
    assert said == [
        "PaperDebugger: step unit_outside (Eq. 4) is recorded, but tests.replayer.kinds.unit_outside is "
        "twice_nowraps.<locals>.wrapper, a wrapper the decorator twice_nowraps defines around the paper step "
        "unit_outside without functools.wraps: a replay finds that wrapper by the step's name, not the step; add "
        "@functools.wraps(fn) to that wrapper",
        "PaperDebugger: step unit_inside (Eq. 4) is recorded, but the function it runs, "
        "twice_nowraps.<locals>.wrapper, is a wrapper the decorator twice_nowraps defines around unit_inside without "
        "functools.wraps, which a replay cannot find again by its name; add @functools.wraps(fn) to that wrapper",
        "PaperDebugger: step unit_lambda (Eq. 4) is recorded, but it is a lambda, which a replay cannot find again by "
        "its name; define it with def at module level"], said
    rec = replayer.open(path)
    assert [rec.step(i).name for i in range(len(rec))] == ["unit_outside", "unit_inside", "unit_lambda"] * 2
    with pytest.raises(ReplayError, match=re.escape(
            "step 0 (unit_outside): tests.replayer.kinds:unit_outside is twice_nowraps.<locals>.wrapper, a wrapper the "
            "decorator twice_nowraps defines around the paper step unit_outside without functools.wraps, and a replay "
            "finds that wrapper by the step's name, not the step; add @functools.wraps(fn) to that wrapper to replay "
            "it")):
        replayer.replay(rec, 0)
    with pytest.raises(ReplayError, match=re.escape(
            "step 1 (unit_inside) runs twice_nowraps.<locals>.wrapper, a wrapper the decorator twice_nowraps defines "
            "around unit_inside without functools.wraps, which a replay cannot find again by its name; add "
            "@functools.wraps(fn) to it, and record again, to replay it")):
        replayer.replay(rec, 1)
    with pytest.raises(ReplayError, match="is a lambda, which has no name to be found again by"):
        replayer.replay(rec, 2)


def swish(t: torch.Tensor) -> torch.Tensor:
    """An activation of the training code's own, defined at module level."""
    return t * torch.sigmoid(t)


def causal(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
    return q_idx >= kv_idx


@recorder.paper_step("Eq. 48", description="attention under a block mask it is given (flex_attention)")
def masked_attention(q: torch.Tensor, block_mask: Any) -> torch.Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, q, q, block_mask=block_mask)


def test_a_write_through_data_the_recording_could_not_see_is_not_called_a_bit_for_bit_match(tmp_path: Path) -> None:
    """An update writing a 2 MiB weight through .data (over the 1 MiB up to which the recorder sees such a write):
    its replay said "MATCH: bit for bit", though the weight it changed was compared with nothing. The replay says
    that argument was changed and not compared, everywhere it gives a verdict; a step that only reads such a
    tensor, and a write the recording saw (a weight under the limit), are a plain match."""
    path = record_data_write(tmp_path / "wide.zarr", 1024)
    rec = replayer.open(path)
    res = replayer.replay(rec, "rmsprop_data_update@iter=0")
    assert res.match and res.unseen_writes == ["args.0"] and [d.name for d in res.outputs] == ["after:args.1"]
    said = ("args.0 as the call left it (changed through .data, which the recording does not see in a tensor over "
            "1 MiB or not on the CPU)")
    assert res.unseen_text == said and f"not compared: {said}: the replayed call changed it" in res.warnings[0]
    assert res.to_json()["unseen_writes"] == ["args.0"]
    assert replayer.replay(rec, "lookup@iter=0").unseen_writes == []
    narrow = replayer.open(record_data_write(tmp_path / "narrow.zarr", 64))
    res = replayer.replay(narrow, "rmsprop_data_update@iter=0")
    assert res.match and res.unseen_writes == [] and {d.name for d in res.outputs} == {"after:args.0", "after:args.1"}
    out = pdbg_here("replay", str(path), "rmsprop_data_update@iter=0", cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.rstrip().endswith(
        f"MATCH: bit for bit, in what was compared; not compared: {said}"), out.stdout
    out = pdbg_here("verify", str(path), cwd=tmp_path)
    updates = [rec.step(f"rmsprop_data_update@iter={i}").index for i in (0, 1)]
    assert out.returncode == 0 and (
        "2 steps of those matched in what was compared; changed through .data, which the recording does not see in "
        "a tensor over 1 MiB or not on the CPU, so not compared as the call left them:\n"
        f"  steps {updates[0]}, {updates[1]} (Eq. 4 (rmsprop_data_update)): args.0\n") in out.stdout, out.stdout
    doc = json.loads(pdbg_here("verify", str(path), "--json", cwd=tmp_path).stdout)
    assert [(m["step"]["index"], m["unseen_writes"]) for m in doc["unseen_writes"]] == [(i, ["args.0"])
                                                                                       for i in updates]


PATCHING_SCRIPT = '''
import sys
import torch
import torch.nn.functional as F
import recorder


def patch():
    F.softsign = recorder.paper_step("Eq. 3", description="torch's softsign, patched")(F.softsign)


{top}


def main():
    {inside}
    with recorder.record(sys.argv[1]):
        for _ in range(2):
            F.softsign(torch.linspace(-3.0, 3.0, 8))


if __name__ == "__main__":
    main()
'''


def test_a_library_function_patched_with_paper_step_replays_where_the_script_patches_it_again(tmp_path: Path) -> None:
    """torch's own function made a paper step by a patch (``F.softsign = paper_step(...)(F.softsign)``): it
    recorded without a word, and the replay refused it, "torch.nn.functional:softsign is not a paper step ...
    now", as if the code had changed. A patch the training script's top level makes (outside its main block)
    is made again when a replay loads the script: the steps replay, and a bundle carries the script. One made
    inside main() is said when the recording first meets the step, and the replay says what happened."""
    said = "PaperDebugger: step softsign (Eq. 3) is recorded, but it is a paper step made at run time"
    for where, top, inside in (("top", "patch()", "pass"), ("main", "", "patch()")):
        project = tmp_path / where
        project.mkdir()
        (project / "train.py").write_text(PATCHING_SCRIPT.format(top=top, inside=inside))
        made = python("train.py", "run.zarr", cwd=project)
        assert made.returncode == 0, made.stderr
        assert made.stderr.count(said) == (where == "main"), made.stderr
        res = pdbg("verify", "run.zarr", cwd=project)
        if where == "top":
            assert res.returncode == 0 and "2 of 2 steps replayed bit for bit (100.0%)" in res.stdout, \
                res.stdout + res.stderr
            continue
        assert f"{said}: paper_step was called on torch.nn.functional.softsign at {project / 'train.py'}:9, " \
               "outside the code that defines it" in made.stderr, made.stderr
        assert "is not a paper step" not in res.stdout and (
            "steps 0, 1 (Eq. 3 (softsign)): step N (softsign) cannot be replayed: torch.nn.functional:softsign is the "
            "function as torch.nn.functional defines it, undecorated, its code the code recorded: the step was a "
            "paper step made at run time, by calling recorder.paper_step on it outside its definition (a patch: "
            "torch.nn.functional.softsign = recorder.paper_step(...)(torch.nn.functional.softsign)), which importing "
            "torch.nn.functional does not do again, nor does the training script's top level, which the replay "
            f"loaded ({project / 'train.py'}); decorate a function defined at the top level of your own code") \
            in res.stdout, res.stdout
    project = tmp_path / "top"
    made = pdbg("bundle", "run.zarr", "0", "-o", "softsign.pdbg", cwd=project)
    assert made.returncode == 0 and "source carried: train.py" in made.stdout, made.stdout + made.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(project / "softsign.pdbg", elsewhere)
    shutil.rmtree(project)
    res = pdbg("replay", "softsign.pdbg", cwd=elsewhere)
    assert res.returncode == 2 and "could not be loaded to look: the training script" in res.stderr and \
        "replay with --use-bundled-source" in res.stderr, res.stderr
    res = pdbg("replay", "softsign.pdbg", "--use-bundled-source", cwd=elsewhere)
    assert res.returncode == 0 and "MATCH: bit for bit" in res.stdout, res.stdout + res.stderr


def test_a_function_of_the_training_code_given_as_an_argument_replays(tmp_path: Path) -> None:
    """A plain function of the training code passed as an argument (an activation; a flex_attention
    BlockMask's mask_mod, the module-level causal) was recorded as opaque "a builtins:function": every
    such step "could not be replayed", while F.gelu passed so replayed. A module-level function is
    recorded by import reference and such steps replay bit for bit; one that really cannot be recorded
    (a lambda) is named by its qualified name, and recording warns of it once, where the step is called."""
    from torch.nn.attention.flex_attention import create_block_mask

    path = tmp_path / "run.zarr"
    block = create_block_mask(causal, B=None, H=None, Q_LEN=16, KV_LEN=16, device="cpu", BLOCK_SIZE=8)
    with warnings.catch_warnings(record=True) as caught, recorder.record(path), torch.no_grad():
        warnings.simplefilter("always")
        Ops.apply(swish, torch.randn(3))
        masked_attention(torch.randn(1, 2, 16, 8), block)
    assert not [w for w in caught if issubclass(w.category, recorder.RecorderWarning)]
    rec = replayer.open(path)
    assert rec.step(0).arguments["args"][0] == {"$function": f"{__name__}:swish"}
    assert rec.step(1).arguments["args"][1]["$object"]["fields"]["mask_mod"] == {"$function": f"{__name__}:causal"}
    for step in rec.steps:
        assert known_refusal(step) is None and replayer.replay(rec, step.index).match, step

    lam = f"the lambda {__name__}:test_a_function_of_the_training_code_given_as_an_argument_replays.<locals>.<lambda>"
    block = create_block_mask(lambda b, h, q, k: q >= k, B=None, H=None, Q_LEN=16, KV_LEN=16, device="cpu",
                              BLOCK_SIZE=8)
    with warnings.catch_warnings(record=True) as caught, recorder.record(tmp_path / "lambda.zarr"), torch.no_grad():
        warnings.simplefilter("always")
        for _ in range(2):
            masked_attention(torch.randn(1, 2, 16, 8), block)
    said = [str(w.message) for w in caught if issubclass(w.category, recorder.RecorderWarning)]
    assert said == [f"PaperDebugger: masked_attention was given block_mask.mask_mod, {lam}, which could not be "
                    "recorded as data (a lambda has no name to import it by: define it with def at module level in the "
                    "training code, which is recorded by its name); its calls given it are recorded but a replay of "
                    "them is refused"], said
    with pytest.raises(ReplayError) as err:
        replayer.replay(tmp_path / "lambda.zarr", 0)
    assert str(err.value).startswith(f"step 0 (masked_attention) was called with a torch BlockMask as block_mask (its "
                                     f"mask_mod: {lam}), which could not be recorded as data (a lambda has"), err.value
    assert "builtins:function" not in str(err.value)


def test_a_function_of_the_training_script_given_as_an_argument_replays(tmp_path: Path) -> None:
    """As above, for a function of a script run by pdbg record: __main__:my_act, found again in the script
    the replay loads."""
    (tmp_path / "train.py").write_text(
        "import torch, recorder\n\n"
        "def my_act(x):\n    return x * torch.sigmoid(x)\n\n"
        "@recorder.paper_step('Eq. 1')\n"
        "def apply(x, act):\n    return act(x)\n\n"
        "if __name__ == '__main__':\n    apply(torch.randn(4), my_act)\n    apply(torch.randn(4), torch.tanh)\n")
    assert pdbg_here("record", "-o", "run.zarr", "--", "train.py", cwd=tmp_path).returncode == 0
    rec = replayer.open(tmp_path / "run.zarr")
    assert rec.step(0).arguments["args"][1] == {"$function": "__main__:my_act"}
    res = pdbg_here("verify", "run.zarr", cwd=tmp_path)
    assert res.returncode == 0 and "2 of 2 steps replayed bit for bit" in res.stdout, res.stdout + res.stderr


@recorder.paper_step("Eq. 21", description="an encoder configured by a SimpleNamespace")
class NamespaceConfigured(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.cfg = cfg
        self.lin = nn.Linear(cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.cfg.scale


@recorder.paper_step("Eq. 22", description="a function given the config")
def configured(x: torch.Tensor, cfg: Any) -> torch.Tensor:
    return x * cfg.scale


def test_a_simple_namespace_config_is_recorded_as_data(tmp_path: Path) -> None:
    """types.SimpleNamespace (argparse-like configs) was opaque: the module's replay raised "has no
    attribute 'cfg'" (counted as a mismatch by verify) and the function step could not be replayed."""
    from types import SimpleNamespace

    path = tmp_path / "run.zarr"
    cfg = SimpleNamespace(width=4, scale=0.5, name="enc")
    with recorder.record(path):
        configured(NamespaceConfigured(cfg)(torch.randn(2, 4)), cfg)
    rec = replayer.open(path)
    assert rec.step("configured").arguments["args"][1] == {"$object": {"type": "types:SimpleNamespace", "fields": {
        "width": 4, "scale": 0.5, "name": "enc"}}}
    for index in range(len(rec)):
        res = replayer.replay(rec, index)
        assert res.compared and res.match, (index, res.warnings)


class AttrConfig(dict):
    """A config read by attribute, as EasyDict keeps one (every item also an attribute)."""

    def __init__(self, d: dict | None = None, **kwargs: Any) -> None:
        super().__init__()
        for k, v in {**(d or {}), **kwargs}.items():
            setattr(self, k, v)

    def __setattr__(self, name: str, value: Any) -> None:
        value = AttrConfig(value) if isinstance(value, dict) and not isinstance(value, AttrConfig) else value
        super().__setattr__(name, value)
        super().__setitem__(name, value)


@recorder.paper_step("Eq. 23", description="an encoder configured by an EasyDict-style config")
class DictConfigured(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.cfg = cfg
        self.lin = nn.Linear(cfg.model.width, cfg.model.width)

    def forward(self, x: torch.Tensor) -> Any:
        h = self.lin(x) * self.cfg.scale
        return AttrConfig(h=h, act=self.cfg.model.act)


@recorder.paper_step("Eq. 24", description="a function given the config and the encoder's output")
def dict_configured(out: Any, cfg: Any) -> torch.Tensor:
    return torch.nn.functional.gelu(out.h) * cfg.scale if out.act == "gelu" else out.h


def test_an_attribute_dict_config_is_recorded_as_its_class(tmp_path: Path) -> None:
    """A config in a dict subclass read by attribute (EasyDict, addict, yacs) was recorded as a plain
    dict: the module rebuilt for replay had a dict where its forward read ``self.cfg.scale`` (an
    AttributeError, a MISMATCH), and so did a function step given it. It is recorded as its class now,
    and so is a step's output of one (its structure is compared with the recording's)."""
    path = tmp_path / "run.zarr"
    cfg = AttrConfig(scale=0.5, model={"width": 4, "act": "gelu"})
    with recorder.record(path):
        dict_configured(DictConfigured(cfg)(torch.randn(2, 4)), cfg)
    rec = replayer.open(path)
    assert rec.step("dict_configured").arguments["args"][1]["$mapping"]["type"] == \
        "tests.replayer.test_replay:AttrConfig"
    for index in range(len(rec)):
        res = replayer.replay(rec, index)
        assert res.compared and res.match, (index, res.warnings)
    # the same output recorded before schema 1.13 (a plain dict) is the same structure, not a mismatch
    from replayer.replay import _by_type

    now = jsonval.encode(AttrConfig(h=torch.ones(1), act="gelu"), tensor_name=lambda t, p: "output.h")
    before = {"h": {"$tensor": "output.h"}, "act": "gelu"}
    assert _by_type(now, as_dicts=True) == _by_type(before, as_dicts=True) and _by_type(now) != _by_type(before)


OLD_FORMAT = ("a limitation of the old format, not a difference in the step; record again with this version to "
              "replay it")


def test_a_replay_of_a_config_kept_as_a_plain_dict_before_1_13_says_so(tmp_path: Path) -> None:
    """A 1.12 recording kept an EasyDict-style config as a plain dict: its replay raised AttributeError ('dict'
    object has no attribute 'scale'), reported as the step's MISMATCH with no word that the old format is why."""
    from tests.sealing import as_plain_dicts, as_schema, rewrite_docs

    path = tmp_path / "run.zarr"
    cfg = AttrConfig(scale=0.5, model={"width": 4, "act": "gelu"})
    with recorder.record(path):
        dict_configured(DictConfigured(cfg)(torch.randn(2, 4)), cfg)
    rewrite_docs(path, as_plain_dicts)
    as_schema(path, "1.12")
    rec = replayer.open(path)
    hint = ("a likely cause: this recording is of schema 1.12, which kept a dict subclass (an EasyDict-style config "
            "read by attribute, an OrderedDict) as a plain dict, and the replay was given that plain dict; "
            f"{OLD_FORMAT} (1.13 keeps its class)")
    for index in range(len(rec)):
        res = replayer.replay(rec, index)
        assert not res.match and "'dict' object has no attribute" in res.exception and hint in res.warnings
    text = pdbg_here("verify", str(path), cwd=tmp_path).stdout
    assert text.count(hint) == len(rec), text


class Activated(nn.Module):
    """A module that keeps its activation function as an attribute (nn.TransformerEncoderLayer does)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = torch.nn.functional.gelu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.lin(x))


def test_a_replay_of_a_module_whose_function_attribute_a_1_5_recording_could_not_keep_says_so(
        tmp_path: Path) -> None:
    """Before 1.6 a function kept as a module attribute was not recorded: the module was rebuilt without it, and
    its replay raised AttributeError, reported as the step's MISMATCH with no word that the old format is why."""
    from tests.sealing import as_schema, rewrite_docs

    path = tmp_path / "run.zarr"
    model = nn.Sequential(Activated())
    with recorder.record(path, model=model, modules=["0"]):
        model(torch.randn(2, 4)).sum().backward()

    def as_1_5(index: int, doc: Any) -> Any:  # the skeleton as 1.5 wrote it: the function unrecorded
        if not (isinstance(doc, dict) and doc.get("attrs", {}).get("act") == {
                "$function": "torch._C._nn:gelu"}):
            return None
        attrs = {k: v for k, v in doc["attrs"].items() if k != "act"}
        return {**doc, "attrs": attrs, "unrecorded": {"act": "builtins:builtin_function_or_method"}, "init": None}

    rewrite_docs(path, as_1_5)
    as_schema(path, "1.5")
    rec = replayer.open(path)
    why = ("this recording is of schema 1.5, which could not keep a builtin_function_or_method as data (the module "
           f"attribute act), so the module was rebuilt without it; {OLD_FORMAT} (since 1.6, torch's functions and "
           "paper steps are kept)")
    with pytest.raises(ReplayError) as err:  # a rebuild without what it lacks: not replayable, not a MISMATCH
        replayer.replay(rec, 0)
    assert "the module was rebuilt incomplete" in str(err.value) and str(err.value).endswith(
        f"(a likely cause: {why})"), str(err.value)
    with pytest.raises(ReplayError) as err:
        replayer.replay(rec, 1)
    assert str(err.value).endswith(f"raised AttributeError: 'Activated' object has no attribute 'act' ({why})")


def test_a_module_backward_of_a_recording_before_1_2_replays(tmp_path: Path) -> None:
    """Before 1.2 every tensor record's requires_grad was false: a module's backward step was refused ("param_grad
    ... has no tensor requiring grad in the replayed forward"), blaming the recording. The parameters whose grads
    the backward step recorded did require grad: they do in the replay, which matches bit for bit."""
    from tests.sealing import as_schema

    path = tmp_path / "run.zarr"
    record_training(path, 1)
    flags = zarr.open_group(path / "rank0", mode="r+")["tensors/requires_grad"].with_config(
        {"write_empty_chunks": True})
    flags[:] = np.zeros(flags.shape, bool)  # (all False: zarr would drop the chunk)
    as_schema(path, "1.1")
    rec = replayer.open(path)
    backward = rec.steps.filter(name="Block", phase="backward")
    assert len(backward) == 2 and not any(r.requires_grad for s in rec.steps for r in s.records)
    for step in backward:
        res = replayer.replay(rec, step)
        assert res.compared and res.match, res.warnings


def test_a_mismatch_after_the_repository_changed_says_so(tmp_path: Path) -> None:
    """A helper in another module that the step calls was edited: the step's own source is as
    recorded, so the MISMATCH came with no word of why. The recording names the git commit; the
    replay says what of the repository is not as it was."""
    import os
    import subprocess

    git = shutil.which("git")
    assert git is not None, "git is needed (Debian's git package)"
    project = tmp_path / "project"
    project.mkdir()
    (project / "helpers.py").write_text("def factor():\n    return 1.0\n")
    (project / "train.py").write_text(
        "import sys, torch, recorder\nfrom helpers import factor\n\n\n@recorder.paper_step('Eq. 4')\n"
        "def scaled(x):\n    return torch.tanh(x) * factor()\n\n\n"
        "with recorder.record(sys.argv[1]):\n    scaled(torch.linspace(-2, 2, 8))\n")
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "first"]):
        subprocess.run([git, *args], cwd=project, env=env, check=True, capture_output=True)
    assert python("train.py", "run.zarr", cwd=project).returncode == 0
    assert replayer.replay(project / "run.zarr", 0).match
    (project / "helpers.py").write_text("def factor():\n    return 1.0001\n")
    res = pdbg("replay", "run.zarr", "0", cwd=project)
    assert res.returncode == 1 and "warning: the repository of the training code" in res.stdout and \
        "has changes not committed since commit " in res.stdout, res.stdout
    subprocess.run([git, "commit", "-qam", "second"], cwd=project, env=env, check=True, capture_output=True)
    res = pdbg("replay", "run.zarr", "0", cwd=project)
    assert res.returncode == 1 and "when recorded and is at " in res.stdout and "git diff " in res.stdout, res.stdout


LIBRARY_SCRIPT = """
import sys

import torch

import recorder

LIB = torch.library.Library("pdbg_twice", "DEF")
LIB.define("scale(Tensor x) -> Tensor")


def _scale(x):
    return x * 3.0


LIB.impl("scale", _scale, "CPU")
torch.library.define("pdbg_twice_frag::shift", "(Tensor x) -> Tensor")


@torch.library.impl("pdbg_twice_frag::shift", "cpu")
def _shift(x):
    return x + 1.0


@recorder.paper_step("Eq. 1")
def scaled(x):
    return torch.ops.pdbg_twice_frag.shift(torch.ops.pdbg_twice.scale(x))


if __name__ == "__main__":
    with recorder.record(sys.argv[1]):
        scaled(torch.linspace(-1, 1, 5))
    if len(sys.argv) > 2:  # replayed by the process that trained, as examples/nan_smooth_relu.py does
        import replayer

        rec = replayer.open(sys.argv[1])
        print("replays:", [replayer.replay(rec, 0).match for _ in range(2)])
"""


def test_a_script_defining_operators_with_torch_library_replays_again_in_one_process(tmp_path: Path) -> None:
    """A script defining its operators with torch.library.Library("ns", "DEF") and torch.library.define (a
    FRAGMENT): each replay loads the script again, and torch refused to register the namespace twice, so only
    the first replay in a process ran (the TUI's r, then b or e failed; a notebook), and a script that trained
    and then replayed failed at its first. Now each replay runs, with the operators' code as it is now."""
    script = tmp_path / "train.py"
    script.write_text(LIBRARY_SCRIPT)
    res = python("train.py", "run.zarr", "replay", cwd=tmp_path)
    assert res.returncode == 0 and "replays: [True, True]" in res.stdout, res.stdout + res.stderr
    rec = replayer.open(tmp_path / "run.zarr")
    x = torch.linspace(-1, 1, 5)
    for _ in range(2):  # (a Replayer each, as the TUI's r and e make)
        again = replayer.replay(rec, 0)
        assert again.match and bits_equal(again.values["output"], x * 3.0 + 1.0)
    script.write_text(LIBRARY_SCRIPT.replace("x * 3.0", "x * 3.5"))  # the operator edited: its new code runs
    edited = replayer.replay(rec, 0)
    assert not edited.match and bits_equal(edited.values["output"], x * 3.5 + 1.0)
    script.write_text(LIBRARY_SCRIPT)
    back = replayer.replay(rec, 0)
    assert back.match and bits_equal(back.values["output"], x * 3.0 + 1.0)


OPERATOR_STEP_SCRIPT = """
import sys

import torch

import recorder


@torch.library.custom_op("pdbg_operator_step::fused", mutates_args=())
@recorder.paper_step("Eq. 3", description="the fused kernel")
def fused(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w) * 1.5


@fused.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[1])


if __name__ == "__main__":
    torch.manual_seed(0)
    with recorder.record(sys.argv[1]):
        fused(torch.randn(2, 3), torch.randn(3, 4))
"""


def test_a_paper_step_a_custom_operator_is_made_of_replays(tmp_path: Path) -> None:
    """A paper step that torch.library.custom_op wraps (@custom_op over @paper_step): recorded as the operator's
    kernel ran it, but its name finds the operator, not the step, and every replay was refused with "train:fused
    is not a paper step now". Now the replay finds the step the operator is made of, and replays it bit for bit."""
    (tmp_path / "train.py").write_text(OPERATOR_STEP_SCRIPT)
    assert python("train.py", "run.zarr", cwd=tmp_path).returncode == 0
    res = pdbg_here("verify", "run.zarr", cwd=tmp_path)
    assert res.returncode == 0 and "1 of 1 step replayed bit for bit" in res.stdout, res.stdout + res.stderr
    again = replayer.replay(tmp_path / "run.zarr", 0)
    torch.manual_seed(0)
    x, w = torch.randn(2, 3), torch.randn(3, 4)
    assert again.match and bits_equal(again.values["output"], torch.tanh(x @ w) * 1.5)


LATE_OPS = """
import torch


@torch.library.custom_op("pdbg_late::soft", mutates_args=())
def soft(x: torch.Tensor) -> torch.Tensor:
    return torch.log1p(torch.exp(x * 2.0)) / 2.0
"""

LATE_SCRIPT = """
import argparse

import torch
from torch import nn

import recorder


@recorder.paper_step("Eq. 3")
class Soft(nn.Module):
    def forward(self, x):
        return torch.ops.pdbg_late.soft(x)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--fused", action="store_true")
    args = parser.parse_args()
    if args.fused:
        import lateops  # registers torch.ops.pdbg_late.soft
    with recorder.record(args.out):
        Soft()(torch.linspace(-2, 2, 8))


if __name__ == "__main__":
    main()
"""


def test_an_operator_an_import_inside_main_registered_is_named_not_a_mismatch(tmp_path: Path) -> None:
    """A custom operator registered by an import inside main() (`if args.fused: import lateops`): a replay
    loads the script's definitions without running main(), so torch.ops had no such operator, and every
    replay was a MISMATCH ("the replay raised AttributeError: '_OpNamespace' 'pdbg_late' object has no
    attribute 'soft'"). Now the step cannot be replayed, in one line naming the operator, the import and what
    to do; and importing that module before replaying, as it says, replays it."""
    (tmp_path / "lateops.py").write_text(LATE_OPS)
    (tmp_path / "train.py").write_text(LATE_SCRIPT)
    assert python("train.py", "run.zarr", "--fused", cwd=tmp_path).returncode == 0
    why = ("the operator torch.ops.pdbg_late.soft is not registered in this process: code a replay does not run "
           "registered it (lateops, imported inside main() of train.py at line 22); import the module that "
           "registers it at module level (the script's top level, not main(), or the step's own file), or in Python "
           "before replaying (import lateops, then replayer.replay)")
    verify = pdbg_here("verify", "run.zarr", cwd=tmp_path)
    assert verify.returncode == 2 and verify.stdout.splitlines() == [
        "run.zarr: no step replayed; 1 step could not be replayed", "could not be replayed:",
        f"  step 0: Eq. 3 (Soft), forward, iteration 0, call 0: step 0 (Soft): {why}"], verify.stdout
    with pytest.raises(ReplayError) as refused:
        replayer.replay(tmp_path / "run.zarr", 0)
    assert str(refused.value) == f"step 0 (Soft): {why}"
    sys.path.insert(0, str(tmp_path))
    try:
        import lateops  # noqa: F401 - registers the operator, as the refusal says to

        assert replayer.replay(tmp_path / "run.zarr", 0).match
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("lateops", None)


ELSEWHERE_OPS = """
import torch


@torch.library.custom_op("pdbg_elsewhere::soft", mutates_args=())
def soft(x: torch.Tensor) -> torch.Tensor:
    return torch.log1p(torch.exp(x * 2.0)) / 2.0
"""

ELSEWHERE_SCRIPT = """
import sys

import torch
from torch import nn

import ops  # noqa: F401 - registers torch.ops.pdbg_elsewhere.soft
import recorder


@recorder.paper_step("Eq. 3")
class Soft(nn.Module):
    def forward(self, x):
        return torch.ops.pdbg_elsewhere.soft(x)


if __name__ == "__main__":
    with recorder.record(sys.argv[1]):
        Soft()(torch.linspace(-2, 2, 8))
"""


def test_a_custom_operator_edited_in_another_file_is_named_where_a_replay_differs(tmp_path: Path) -> None:
    """The body of a custom operator in another file of the project (ops.py) edited after recording: the
    step's own code (Soft, in train.py) is as recorded, and the replay was a bare MISMATCH. Now it names the
    file the call ran code from that was modified after the recording began, with the function; and where the
    file's time says nothing (kept as it was), that the code it ran there is not checked against the recording."""
    ops = tmp_path / "ops.py"
    ops.write_text(ELSEWHERE_OPS)
    (tmp_path / "train.py").write_text(ELSEWHERE_SCRIPT)
    assert python("train.py", "run.zarr", cwd=tmp_path).returncode == 0
    started = replayer.open(tmp_path / "run.zarr").run_info["started_unix"]
    ops.write_text(ELSEWHERE_OPS.replace("x * 2.0", "x * 2.01"))
    os.utime(ops, (time.time() + 5, time.time() + 5))
    res = pdbg_here("replay", "run.zarr", "0", "--json", cwd=tmp_path)
    doc = json.loads(res.stdout)
    assert res.returncode == 1 and doc["warnings"] == [
        f"{ops} was modified after the recording began, and the step's call ran soft from it: its code may not be "
        "what ran (a likely cause of any difference)"], doc["warnings"]
    os.utime(ops, (started - 60, started - 60))
    res = pdbg_here("replay", "run.zarr", "0", "--json", cwd=tmp_path)
    doc = json.loads(res.stdout)
    assert res.returncode == 1 and doc["warnings"] == [
        f"the step's call ran code of the training project outside its recorded definition (soft in {ops}), of "
        "which the recording holds no hash: whether it changed since recording is not checked (a likely cause of "
        "the difference if it did: a helper or custom operator edited since); its files were not modified after the "
        "recording began, so another likely cause is a value that code reads which the training changed as it ran "
        "and a recording does not hold (an item of a module-level dict, an attribute of a module-level object or "
        "class: SCHEDULE[\"tau\"] set in the loop, read by a custom Function's forward): pass it to the step as an "
        "argument"], doc["warnings"]


ANNEAL_SCRIPT = """
import sys

import torch

import recorder

SCHEDULE = {"tau": 1.0}


class Anneal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.tau = SCHEDULE["tau"]
        return torch.sigmoid(x / ctx.tau)

    @staticmethod
    def backward(ctx, g):
        return g / ctx.tau * 0.25


@recorder.paper_step("Eq. 13")
def gate(x):
    return Anneal.apply(x)


if __name__ == "__main__":
    with recorder.record(sys.argv[1]):
        for it in range(2):
            SCHEDULE["tau"] = 1.0 / (it + 1)
            gate(torch.linspace(-1, 1, 4))
"""


def test_a_value_a_custom_function_reads_that_training_changed_is_named_as_a_likely_cause(tmp_path: Path) -> None:
    """A custom Function's forward reading a module-level dict item the training loop changes (an annealed
    temperature): a replay loads the script's own value, and the differing replay said only that the code it ran
    outside the step is not hashed, "a likely cause if it did: a helper or custom operator edited since", though
    no file changed. It now names a value the training changed that the recording does not hold as the likely
    cause, and what to do."""
    (tmp_path / "train.py").write_text(ANNEAL_SCRIPT)
    assert python("train.py", "run.zarr", cwd=tmp_path).returncode == 0
    first, second = (replayer.replay(tmp_path / "run.zarr", k) for k in (0, 1))
    assert first.match and not second.match
    assert any("a value that code reads which the training changed as it ran and a recording does not hold" in w
               and "Anneal.forward" in w for w in second.warnings), second.warnings


_KERNELS: dict = {}


def _supplies_cfg(fn: Any) -> Any:
    """A decorator that supplies an argument itself (its wrapper takes no cfg)."""
    import functools

    @functools.wraps(fn)
    def wrapper(x: torch.Tensor) -> torch.Tensor:
        return fn(x, cfg={"scale": 2.0})

    return wrapper


@recorder.paper_step("Eq. 24", description="a decorated function whose decorator supplies cfg")
@_supplies_cfg
def supplied(x: torch.Tensor, cfg: dict = {}) -> torch.Tensor:  # noqa: B006 - the idiom under test
    return x * cfg.get("scale", 1.0)


@recorder.paper_step("Eq. 25", description="a function keeping a cache of kernels in a default")
def cached(x: torch.Tensor, kernels: dict = _KERNELS) -> torch.Tensor:  # noqa: B006 - the idiom under test
    kernel = kernels.setdefault(x.shape[-1], lambda t: t * 3)
    return kernel(x)


@recorder.paper_step("Eq. 26", description="a module's warm-up, its count in a mutable default of forward")
class WarmUpModule(nn.Module):
    def forward(self, x: torch.Tensor, state: dict = {"t": 0}) -> torch.Tensor:  # noqa: B006 - the idiom
        state["t"] += 1
        return x * min(1.0, state["t"] / 10)


def test_mutable_defaults_are_recorded_only_where_they_are_the_steps_data(tmp_path: Path) -> None:
    """A decorator supplying the argument itself (the recording passed cfg= to its wrapper: a
    TypeError only while recording); a cache of functions (recorded as opaque: no replay at all);
    a module forward's counter (not recorded, unlike a function's)."""
    path = tmp_path / "run.zarr"
    module = WarmUpModule()
    with recorder.record(path):
        for _ in range(3):
            x = torch.randn(3)
            assert torch.equal(supplied(x), x * 2.0)
            cached(x)
            module(x)
    rec = replayer.open(path)
    assert rec.step("cached@iter=0#1").arguments["kwargs"] == {}
    assert rec.step("WarmUpModule@iter=0#2").arguments["kwargs"] == {"state": {"t": 2}}
    for index in range(len(rec)):
        res = Replayer(rec).replay(index)
        assert res.compared and res.match, (rec.step(index), res.warnings)


device = "cpu"  # a module-level name that is also an attribute the step below reads


def reads_an_attribute(x: torch.Tensor) -> torch.Tensor:
    return x.to(x.device) * [TEMPERATURE for _ in range(1)][0]


def test_the_module_level_data_hint_names_global_reads_not_attributes() -> None:
    """``x.device`` was named as a read of the module-level ``device``; a read inside a comprehension
    was not named."""
    from replayer.replay import _data_globals

    assert _data_globals(reads_an_attribute) == ["TEMPERATURE (float)"]


@recorder.paper_step("Eq. 25", description="a scan written as a recursion: h_t = tanh(h_{t-1} + x_t)")
def recursive_scan(xs: torch.Tensor, t: int) -> torch.Tensor:
    return xs[0] if t == 0 else torch.tanh(recursive_scan(xs, t - 1) + xs[t])


def test_a_step_recursing_hundreds_deep_is_recorded_and_replayed(tmp_path: Path) -> None:
    """Each recorded call of a recursive step took four frames of Python's recursion limit instead
    of one: a scan 300 deep, fine unrecorded, raised RecursionError in the training when recorded
    (the warning said training continued). The recorder makes room for its own frames, and puts
    Python's limit back when the recording closes."""
    import sys

    depth, limit = 300, sys.getrecursionlimit()
    xs = torch.randn(depth + 1, 4, requires_grad=True)
    expected = recursive_scan(xs, depth)  # unrecorded
    path = tmp_path / "run.zarr"
    with recorder.record(path) as run:
        out = recursive_scan(xs, depth)
        out.sum().backward()
    assert torch.equal(out, expected) and run.status == "complete" and sys.getrecursionlimit() == limit
    rec = replayer.open(path)
    assert len(rec.steps.filter(phase="forward")) == depth + 1
    res = replayer.replay(rec, 0)
    assert res.match and len(res.inner) == depth and all(s.match for s in res.inner)
    assert sys.getrecursionlimit() == limit
    from tui.cmd_replay import summary  # pdbg info: the recursion's time once (it said 15000%)

    (forward,) = [p for p in summary(rec)["paper_steps"] if p["forward_calls"]]
    assert 0 < forward["time_share"] <= 1, forward



@recorder.paper_step("Algorithm 5", description="a chain of n more calls of itself, each using its parameters")
class SelfChain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, n: int) -> torch.Tensor:
        y = self.lin(x)
        return y if n == 0 else self(torch.tanh(y), n - 1)


def test_a_module_step_that_calls_itself_replays_with_each_nested_call_compared(tmp_path: Path) -> None:
    """Replaying a recursive module step (a Tree-LSTM's encoder) said MISMATCH, exit 1, when it reproduced
    bit for bit: the replay never saw the module's calls of itself, and listed each as "recorded, but not
    called during the replay", forward and backward (and so did a bundle of it, and its repro.py). Each is
    now paired with its recording and compared; a call of itself inside a chain once deep leaves its own
    share of the parameter grads out (the replay has only their total over both calls)."""
    torch.manual_seed(0)
    enc, chain = TreeEncoder(), SelfChain()
    path = tmp_path / "run.zarr"
    with recorder.record(path, mode="full"):
        out = enc(((1, (2, 3)), 4)).sum() + chain(torch.randn(4, requires_grad=True), 1).sum()
        out.backward()
    rec = replayer.open(path)
    tops = [s for s in rec.steps if s.parent is None]
    assert [(s.name, s.phase) for s in tops] == [("TreeEncoder", "forward"), ("SelfChain", "forward"),
                                                 ("SelfChain", "backward"), ("TreeEncoder", "backward")]
    for top in tops:
        res = replayer.replay(rec, top)
        calls = 6 if top.name == "TreeEncoder" else 1  # the calls of itself inside the outermost
        assert res.match and res.unrecorded_inner is None and all(s.match for s in res.inner), \
            (top.index, [(s.step.index, s.reason, [d.summary() for d in s.diffs if not d.match]) for s in res.inner])
        assert sum(s.step.name == top.name for s in res.inner) == calls, (top.index, len(res.inner))
    done = pdbg_here("replay", str(path), "TreeEncoder#0", cwd=tmp_path)
    assert done.returncode == 0 and "inner steps: 6 of 6 match" in done.stdout, done.stdout


@recorder.paper_step("Eq. 27", description="one ponder step of adaptive computation time")
def ponder_step(s: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(s @ w + x)


@recorder.paper_step("Algorithm 6", description="ponder until the halting mass reaches 1 (at most 12 steps)")
class Ponder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4) * 0.3)
        self.halt = nn.Linear(4, 1)
        nn.init.zeros_(self.halt.weight)
        nn.init.zeros_(self.halt.bias)  # a halting probability of 1/2 a step: two steps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, mass, n = torch.zeros_like(x), torch.zeros(()), 0
        while mass < 1 and n < 12:  # a data-dependent trip count
            s = ponder_step(s, x, self.w)
            mass = mass + torch.sigmoid(self.halt(s)).mean()
            n += 1
        return s


def test_inner_calls_a_replay_makes_beyond_the_recorded_ones_are_reported(tmp_path: Path) -> None:
    """An edit that makes an adaptive-computation loop ponder 12 steps instead of the 2 recorded: the
    replay said "inner steps: 2 of 2 match" and dropped the 10 other calls silently. They are counted,
    the first named, in the result, its JSON, the command line, the notebook and the TUI, and a replay
    that made them is no match, forward and backward."""
    from tui.app import render_replay

    torch.manual_seed(0)
    net = Ponder()
    path = tmp_path / "run.zarr"
    with recorder.record(path, mode="full"):
        net(torch.randn(3, 4, requires_grad=True)).sum().backward()
    rec = replayer.open(path)
    assert replayer.replay(rec, "Ponder#0").match
    for selector in ("Ponder#0", "Ponder#0:backward"):
        res = replayer.replay(rec, selector, edit={"halt.bias": "x-5"})
        assert len(res.inner) == 2 and not res.match, selector
        assert selector.endswith(":backward") or all(s.match for s in res.inner)  # (the halting bias sets no s)
        extra = res.to_json()["unrecorded_inner"]
        assert extra == {"count": 10, "first": {"name": "ponder_step", "module_path": rec.step(0).module_path,
                                                "call": 2, "recorded": 2}}, extra
        text = "10 inner calls made during the replay were not recorded (the first: ponder_step at "
        assert text in res.unrecorded_inner.text and text in render_replay(res).plain
        assert text in res._repr_html_()  # the notebook
    done = pdbg_here("replay", str(path), "Ponder#0", "--edit", "halt.bias=x-5", cwd=tmp_path)
    assert done.returncode == 1 and f"inner steps: 2 of 2 match; {text}" in done.stdout, done.stdout


@recorder.paper_step("Eq. 26", description="EMA teacher update, in place, over lists of parameters")
def ema_teacher(teacher: list[torch.Tensor], student: list[torch.Tensor], m: float = 0.99) -> None:
    with torch.no_grad():
        for t, s in zip(teacher, student, strict=True):
            t.mul_(m).add_(s, alpha=1 - m)


def test_an_in_place_update_of_parameters_replays_without_torch_warnings(tmp_path: Path) -> None:
    """Replaying an EMA update over lists of parameters printed torch's warning about reading the
    .grad of a tensor that is not a leaf (twice)."""
    import warnings

    student, teacher = nn.Linear(4, 4), nn.Linear(4, 4)
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    with recorder.record(tmp_path / "run.zarr", model=student, optimizer=opt):
        for _ in range(2):
            student(torch.randn(2, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            ema_teacher(list(teacher.parameters()), list(student.parameters()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = replayer.replay(tmp_path / "run.zarr", "Eq. 26@iter=1")
    assert res.match and res.compared and [str(w.message)[:60] for w in caught] == []


def test_environment_differences_name_the_operating_system_and_not_a_spelling_of_the_architecture() -> None:
    """A recording from Windows said "machine: recorded AMD64, here x86_64" (the same architecture)
    and nothing of Windows against Linux."""
    import platform

    from replayer.state import environment_differences

    here = platform.platform().split("-", 1)[0]
    other = "Windows" if here != "Windows" else "Linux"
    machine = {"x86_64": "AMD64", "AMD64": "x86_64"}.get(platform.machine(), platform.machine())
    said = environment_differences({"machine": machine, "platform": f"{other}-10-10.0.19045-SP0"})
    assert said == [f"operating system: recorded {other}, here {here}"], said
    assert environment_differences({"machine": platform.machine(), "platform": platform.platform()}) == []


def test_a_bundled_script_that_does_not_parse_here_names_the_python_version(tmp_path: Path) -> None:
    """A bundle's copy of a script written for a newer Python (`type Shape = ...` on 3.11) was
    "does not parse now; fix it", for a file the receiver does not have."""
    import platform

    from replayer.code import script_module

    with pytest.raises(ReplayError) as raised:
        script_module("/home/alice/proj/train.py", text="def f(:\n    pass\n")
    assert str(raised.value).startswith(
        "the bundle's copy of the training script /home/alice/proj/train.py does not parse with this Python "
        f"({platform.python_version()}; line 1: "), str(raised.value)
    assert str(raised.value).endswith("replay it with the Python version it was recorded with (pdbg info names it)")


@pytest.mark.parametrize("mode, options, why, kept", [
    ("stats", {}, "the run was recorded in stats mode, which keeps statistics only",
     "none (stats mode: statistics only; nothing can be replayed)"),
    ("full", {"every": 2}, "the run kept tensors every 2 iterations (--every 2), and this is iteration 1: the nearest "
     "kept are 0 and 2", "every 2 iterations (--every 2: iterations 0, 2, 4, ...)"),
    ("flight", {"keep": 1}, "flight mode keeps the tensors of the iterations its ring wrote out (3), and iteration 1 "
     "is not one of them", "iterations 3 (the flight ring, written out at: end)"),
])
def test_which_iterations_kept_their_tensors_is_said(tmp_path: Path, mode: str, options: dict[str, Any], why: str,
                                                     kept: str) -> None:
    """Every statistics-only answer guessed among three causes ("stats mode, an iteration --every
    skipped, or flight mode outside the ring"), and pdbg info did not say which iterations can be
    replayed: the recording knows its mode, its every, and what its ring wrote out."""
    from tui.cmd_replay import summary

    path = tmp_path / "run.zarr"
    with recorder.record(path, mode=mode, **options) as run:
        for i in range(4):
            project(torch.full((2, 4), float(i)), torch.ones(4, 3))
            run.next_iteration()
    rec = replayer.open(path)
    record = rec.step("Eq. 9@iter=1").records[0]
    assert not record.has_payload and rec.rank.why_statistics_only(record) == why
    assert summary(rec)["tensors_kept"] == kept


def test_a_call_under_inference_mode_with_grad_enabled_has_no_backward_step(tmp_path: Path) -> None:
    """`with torch.inference_mode(), torch.enable_grad():` (a test-time-adaptation helper) makes no
    graph, but grad mode is on: the call was given a backward step, which took the parameter grads
    of the next training call's pass, and the replay called them a total over two calls."""
    layer = Shared()
    opt = torch.optim.SGD(layer.parameters(), lr=0.01)
    with recorder.record(tmp_path / "run.zarr", model=layer, optimizer=opt):
        for _ in range(2):
            with torch.inference_mode(), torch.enable_grad():
                layer(torch.randn(3, 4))
            layer(torch.randn(3, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    rec = replayer.open(tmp_path / "run.zarr")
    backward = rec.steps.filter(phase="backward")
    assert len(backward) == 2 and [rec.step(s.forward).call for s in backward] == [1, 1]
    assert not rec.step("Eq. 4@iter=0#0").grad_enabled and "forward (no grad)" in repr(rec.step("Eq. 4@iter=0#0"))
    for step in backward:
        res = replayer.replay(rec, step.index)
        assert res.match and not [w for w in res.warnings if "total over" in w], res.warnings


def test_a_vectorized_jacobian_through_a_step_keeps_the_recording_going(tmp_path: Path) -> None:
    """autograd.functional.jacobian(step, x, vectorize=True) runs one batched backward pass, whose
    gradients cannot be detached: the recorder stopped for the rest of the run. The batched pass is
    left out; the run's ordinary backward passes are recorded and replay."""
    import warnings

    w = torch.randn(4, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught, recorder.record(tmp_path / "run.zarr") as run:
        warnings.simplefilter("always")
        for _ in range(2):
            x = torch.randn(4)
            jacobian = torch.autograd.functional.jacobian(lambda t: configured(t, SimpleConfig()), x, vectorize=True)
            (configured(x * w, SimpleConfig()).sum() + jacobian.sum()).backward()
            run.next_iteration()
    assert run.status == "complete" and not [w for w in caught if "stopped recording" in str(w.message)]
    rec = replayer.open(tmp_path / "run.zarr")
    assert len(rec.steps.filter(phase="forward")) == 4 and len(rec.steps.filter(phase="backward")) == 2
    for step in rec.steps:
        assert replayer.replay(rec, step.index).match, step


class SimpleConfig:
    scale = 0.5


def test_a_tensor_the_flight_ring_could_not_hold_says_so(tmp_path: Path) -> None:
    """A tensor of an iteration the ring wrote out, whose bytes did not fit in it (max_ring_bytes),
    was said to be of an iteration outside the ring."""
    import warnings

    path = tmp_path / "run.zarr"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the ring says it overflowed)
        with recorder.record(path, mode="flight", keep=1, max_ring_bytes=100_000) as run:
            for i in range(2):
                project(torch.full((200, 64), float(i)), torch.ones(64, 64))
                run.next_iteration()
    rec = replayer.open(path)
    assert rec.rank.ring_iterations() == [1]
    lost = [r for r in rec.step("Eq. 9@iter=1").records if not r.has_payload]
    assert lost and rec.rank.why_statistics_only(lost[0]) == (
        "flight mode wrote out iteration 1, but not this tensor's bytes: they did not fit in the ring (record with "
        "a larger max_ring_bytes)")


def test_nan_that_differs_is_said_to_differ_not_measured(capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    """A recorded NaN replayed as 0 showed "max abs inf" and "ULP 2143289344", and two NaN that differ only
    in their bits "max abs inf" and "ULP 4194303": no distance means anything there. The comparison says
    which differ (NaN positions, NaN bits), with no max abs (null in JSON) and no ULP count."""
    from replayer.compare import compare
    from tui.cmd_replay import _outputs_table

    recorded = torch.tensor([float("nan"), 1.0, 2.0, 3.0])
    moved = compare("output", "output", recorded, torch.tensor([0.0, 1.0, 2.5, 3.0]))
    assert not moved.match and moved.mismatched == 2 and moved.max_ulp is None and moved.nonfinite_differs
    assert moved.reason == ("NaN/Inf positions differ: 1 value NaN in the recording and not in the replay; 1 value "
                            "finite in both differs too, by at most 0.5 (rel 0.25)"), moved.reason
    doc = moved.to_json()
    assert doc["max_abs_diff"] is None and doc["max_rel_diff"] is None and doc["max_ulp"] is None
    json.dumps(doc, allow_nan=False)
    other_bits = recorded.clone()
    other_bits.view(torch.int32)[0] ^= 1  # another NaN payload
    bits = compare("output", "output", recorded, other_bits)
    assert not bits.match and bits.mismatched == 1 and bits.max_ulp is None
    assert bits.reason == "NaN bits differ: 1 value NaN in both whose bits differ (sign or payload)", bits.reason
    assert bits.summary() == f"output: {bits.reason}"
    monkeypatch.setenv("COLUMNS", "160")  # a wide terminal: recorded and replayed side by side, one row
    _outputs_table([moved])
    table = capsys.readouterr().out
    row = next(line for line in table.splitlines() if line.lstrip().startswith("output"))
    assert row.split()[-2:] == ["-", "-"] and "2143289344" not in table, table
    assert "NaN/Inf positions differ" in table
    finite = compare("output", "output", torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5]))
    assert finite.max_ulp == 2 ** 21 and finite.max_abs_diff == 0.5 and finite.reason is None and finite.measured
    # An edit that gives an expert 2 tokens where it had none: "max abs inf, ULP 0" was shown
    grown = compare("output", "output", torch.zeros(0, 32), torch.ones(2, 32))
    assert not grown.match and not grown.measured and not grown.nonfinite_differs
    assert grown.reason == "shapes differ: recorded float32[0, 32], replayed float32[2, 32]", grown.reason
    doc = grown.to_json()
    assert doc["max_abs_diff"] is None and doc["max_rel_diff"] is None and doc["max_ulp"] is None
    _outputs_table([grown])
    table = capsys.readouterr().out
    row = next(line for line in table.splitlines() if line.lstrip().startswith("output"))
    assert row.split()[-2:] == ["-", "-"], table


def test_complex_nan_that_differs_is_counted_by_element(capsys: pytest.CaptureFixture[str]) -> None:
    """A complex NaN is one value, as the statistics and ``mismatched`` count it: the reason said
    "4 values NaN" for 2 NaN elements (each real and imaginary part counted), and "2 values finite in
    both differ" for one element whose two parts differ. The table says its statistics are of |z|."""
    from recorder.stats import host_stats
    from replayer.compare import compare, stats_dict
    from tui.cmd_replay import _outputs_table

    nan = complex(float("nan"), float("nan"))
    recorded = torch.tensor([nan, nan, 1 + 1j, 2 + 2j, complex(float("inf"), float("nan"))], dtype=torch.complex64)
    replayed = torch.tensor([1 + 0j, 1 + 0j, 1.5 + 1.5j, 2 + 2j, 0j], dtype=torch.complex64)
    diff = compare("output", "output", recorded, replayed)
    assert stats_dict(host_stats(recorded))["nan"] == 2 and diff.mismatched == 4
    assert diff.reason == ("NaN/Inf positions differ: 2 values NaN in the recording and not in the replay, 1 value Inf "
                           "in one and not the same value in the other; 1 value finite in both differs too, by at "
                           "most 0.5 (rel 0.5)"), diff.reason
    moved = recorded.clone()
    torch.view_as_real(moved)[0, 1] = 3.0  # one part of a NaN made finite: the element is NaN in both still
    bits = compare("output", "output", recorded, moved)
    assert bits.mismatched == 1 and bits.reason == ("NaN bits differ: 1 value NaN in both whose bits differ (sign or "
                                                    "payload)"), bits.reason
    _outputs_table([diff, compare("args.0", "input", torch.ones(2), torch.ones(2))])
    assert "(the statistics of complex output are of magnitudes |z|)" in capsys.readouterr().out


_CFG_SCRIPT = '''"""Classifier-free guidance label dropping that draws from module-level generator objects."""
import sys
import numpy as np, torch
import recorder

NULL, P_UNCOND = 10, 0.5
RNG = np.random.default_rng(0)
GEN = torch.Generator().manual_seed(0)

@recorder.paper_step("CFG: drop labels (numpy Generator)")
def drop_labels_np(y):
    keep = torch.from_numpy(RNG.random(y.shape[0]) >= P_UNCOND)
    return torch.where(keep, y, torch.full_like(y, NULL))

@recorder.paper_step("CFG: drop labels (torch Generator)")
def drop_labels_torch(y):
    keep = torch.rand(y.shape[0], generator=GEN) >= P_UNCOND
    return torch.where(keep, y, torch.full_like(y, NULL))

if __name__ == "__main__":
    with recorder.record(sys.argv[1]) as run:
        for it in range(4):
            y = torch.arange(64) % 10
            drop_labels_np(y); drop_labels_torch(y)
            run.next_iteration()
'''


def test_a_step_drawing_from_a_module_level_generator_replays_alone_in_verify_and_in_a_bundle(tmp_path: Path) -> None:
    """A step that draws from a module-level numpy Generator or torch.Generator (CFG label dropping)
    replays bit for bit alone (its generator set to the recorded state), so `pdbg verify` no longer
    depends on replaying the steps in order: a sample agrees with the whole, and a bundle verifies."""
    (tmp_path / "cfg_drop.py").write_text(_CFG_SCRIPT)
    made = python("cfg_drop.py", "run.zarr", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    rec = replayer.open(tmp_path / "run.zarr")
    for name in ("drop_labels_np", "drop_labels_torch"):
        for it in (2, 0):  # a fresh load of the script each time: its generators start anew
            res = replayer.replay(rec, f"{name}@iter={it}")
            assert res.match and res.compared, (name, it, res.warnings)
            assert bits_equal(res.values["output"], rec.step(f"{name}@iter={it}").tensor("output"))
    whole = pdbg("verify", "run.zarr", cwd=tmp_path)
    assert whole.returncode == 0 and "8 of 8 steps replayed bit for bit (100.0%)" in whole.stdout, whole.stdout
    sample = pdbg("verify", "run.zarr", "--sample", "3", cwd=tmp_path)
    assert sample.returncode == 0 and "3 of 3 steps replayed bit for bit (100.0%)" in sample.stdout, sample.stdout
    for i, name in enumerate(("drop_labels_np", "drop_labels_torch")):
        bundled = pdbg("bundle", "run.zarr", f"{name}@iter=2", "-o", f"b{i}.pdbg", "--verify", cwd=tmp_path)
        assert bundled.returncode == 0 and "verified: the bundle replays bit for bit" in bundled.stdout, \
            bundled.stdout + bundled.stderr


_CFG_NP = np.random.default_rng(0)
_CFG_GEN = torch.Generator().manual_seed(0)
_CFG_LEGACY = np.random.RandomState(1)
_CFG_PY = random.Random(2)
_CFG_SYSTEM = random.SystemRandom()
_P_DROP = 0.5


def _cfg_keep(n: int) -> torch.Tensor:
    """A helper the step calls: what it draws from is found through it."""
    return torch.from_numpy(_CFG_LEGACY.rand(n) >= _P_DROP) & torch.tensor([_CFG_PY.random() >= _P_DROP
                                                                            for _ in range(n)])


@recorder.paper_step("Eq. 31", description="CFG label dropping from module-level generator objects")
def cfg_drop_labels(y: torch.Tensor) -> torch.Tensor:
    keep = torch.from_numpy(_CFG_NP.random(y.shape[0]) >= _P_DROP) & (torch.rand(y.shape[0], generator=_CFG_GEN)
                                                                      >= _P_DROP) | _cfg_keep(y.shape[0])
    return torch.where(keep, y, torch.full_like(y, 10))


@recorder.paper_step("Eq. 32", description="CFG label dropping from the operating system's randomness")
def cfg_drop_system(y: torch.Tensor) -> torch.Tensor:
    keep = torch.tensor([_CFG_SYSTEM.random() >= _P_DROP for _ in range(y.shape[0])])
    return torch.where(keep, y, torch.full_like(y, 10))


def _generator_states() -> tuple[Any, ...]:
    return (_CFG_NP.bit_generator.state, _CFG_GEN.get_state(), _CFG_LEGACY.get_state(legacy=False), _CFG_PY.getstate())


def _same_states(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return (a[0] == b[0] and torch.equal(a[1], b[1]) and np.array_equal(a[2]["state"]["key"], b[2]["state"]["key"])
            and a[2]["state"]["pos"] == b[2]["state"]["pos"] and a[3] == b[3])


def test_a_replay_in_the_recording_process_sets_its_generators_and_gives_them_back(run_path: Path) -> None:
    """In the process that recorded (a notebook), a replay runs the caller's own code: the module-level
    generators (numpy Generator and RandomState, torch.Generator, random.Random, read through a helper
    too) are set to the recorded states for the call and left as the caller had them; a generator whose
    state cannot be recorded (SystemRandom) is what the mismatch warning names, not the constants."""
    y = torch.arange(64) % 10
    with recorder.record(run_path):
        for _ in range(3):
            cfg_drop_labels(y)
        cfg_drop_system(y)
    rec = replayer.open(run_path)
    assert {"global:_CFG_NP", "global:_CFG_GEN", "global:_CFG_LEGACY", "global:_CFG_PY"} <= set(rec.step(1).rng)
    cfg_drop_labels(y)  # the caller's generators move on
    before = _generator_states()
    for index in (1, 0, 2):
        res = replayer.replay(rec, index)
        assert res.match and bits_equal(res.values["output"], rec.step(index).tensor("output")), res.warnings
        assert _same_states(_generator_states(), before)
    res = replayer.replay(rec, 3)
    assert not res.match
    drawn = [w for w in res.warnings if "module-level RNG" in w]
    assert drawn and "_CFG_SYSTEM (random.SystemRandom)" in drawn[0], res.warnings
    assert not any("_P_DROP" in w for w in res.warnings), res.warnings


_MAIN_RNG_SCRIPT = '''"""Jitter from the run's numpy Generator, made by main() from a --seed flag (None on import)."""
import sys
import numpy as np, torch
import recorder

RNG = None  # set by main() from the command line


@recorder.paper_step("Eq. 14", description="jitter from the run's seeded numpy Generator")
def jitter(x, scale):
    return x + scale * torch.from_numpy(RNG.standard_normal(x.shape).astype(np.float32))


def main(out, seed):
    global RNG
    RNG = np.random.default_rng(seed)
    lin = torch.nn.Linear(6, 6)
    with recorder.record(out) as run:
        for _ in range(3):
            jitter(lin(torch.randn(2, 6)), 0.1).pow(2).mean().backward()
            run.next_iteration()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
'''


def test_a_module_level_generator_main_made_is_made_again_from_the_recording(tmp_path: Path) -> None:
    """A step reading a module-level numpy Generator that the script's main() makes (RNG = None at import,
    the argparse pattern) replays bit for bit, forward and backward, in any order: a replay loads the script
    without running main(), so the generator is made of the recorded kind in its recorded state, bound for
    the call and said so; the loaded module's RNG is None again after."""
    (tmp_path / "jit.py").write_text(_MAIN_RNG_SCRIPT)
    made = python("jit.py", "run.zarr", "17", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    rec = replayer.open(tmp_path / "run.zarr")
    assert "global:RNG" in rec.step("jitter@iter=0").rng
    r = Replayer(rec)
    for which in ("jitter@iter=2", "jitter@iter=0", "jitter@iter=1:backward"):
        res = r.replay(which)
        step = rec.step(which)
        name = "output" if step.phase == "forward" else "args.0"
        assert res.match and bits_equal(res.values[name], step.tensor(name)), (which, res.warnings)
        assert ("the module-level RNG was a numpy Generator when recorded (the training script made it as it ran); "
                "loading the code binds it to None: replayed with one made from the recording, in its recorded "
                "state") in res.warnings, res.warnings
    defn = rec.step("jitter@iter=0").definition
    assert r.loader.resolve(defn["ref"], defn.get("file")).__wrapped__.__globals__["RNG"] is None


_HELD_SCRIPT = '''"""Noise layers holding their own generators: each kind, on a submodule, one replaced in training."""
import sys
import numpy as np, torch
from torch import nn
import recorder


@recorder.paper_step("Eq. 40", description="multiplicative noise from the module's own torch.Generator")
class NoisyGate(nn.Module):
    def __init__(self):
        super().__init__(); self.gen = torch.Generator().manual_seed(0)
    def forward(self, x):
        return x * (1 + 0.1 * torch.randn(x.shape, generator=self.gen))


@recorder.paper_step("Eq. 41", description="noise from the module's own numpy Generator")
class NoisyNp(nn.Module):
    def __init__(self):
        super().__init__(); self.rng = np.random.default_rng(0)
    def forward(self, x):
        return x * torch.from_numpy(1 + 0.1 * self.rng.standard_normal(x.shape).astype(np.float32))


@recorder.paper_step("Eq. 42", description="noise from a legacy RandomState and from a bit generator alone")
class Legacy(nn.Module):
    def __init__(self):
        super().__init__(); self.rs = np.random.RandomState(3); self.bits = np.random.PCG64(4)
    def forward(self, x):
        a = torch.from_numpy(self.rs.rand(*x.shape).astype(np.float32))
        return x * a + torch.from_numpy(np.random.Generator(self.bits).random(x.shape, dtype=np.float32))


class Inner(nn.Module):  # not a step: its generator is found from the step that holds it
    def __init__(self):
        super().__init__(); self.gen = torch.Generator().manual_seed(1); self.lin = nn.Linear(8, 8)
    def forward(self, x):
        return self.lin(x) * torch.rand(x.shape, generator=self.gen)


@recorder.paper_step("Eq. 43", description="a submodule's generator")
class Outer(nn.Module):
    def __init__(self):
        super().__init__(); self.inner = Inner()
    def forward(self, x):
        return self.inner(x) * 2


@recorder.paper_step("Eq. 44", description="a generator the training loop replaces (reseeded each epoch)")
class Reseeded(nn.Module):
    def __init__(self):
        super().__init__(); self.gen = torch.Generator().manual_seed(5)
    def forward(self, x):
        return x + torch.rand(x.shape, generator=self.gen)


if __name__ == "__main__":
    torch.manual_seed(0)
    mods = [NoisyGate(), NoisyNp(), Legacy(), Outer(), Reseeded()]
    with recorder.record(sys.argv[1]) as run:
        for it in range(4):
            if it == 2:
                mods[-1].gen = torch.Generator().manual_seed(50)
            x = torch.linspace(-1, 1, 32).reshape(4, 8).requires_grad_()  # the same each call: only the noise differs
            for m in mods:
                m(x).sum().backward()
            run.next_iteration()
'''
_HELD_STEPS = ("NoisyGate", "NoisyNp", "Legacy", "Outer", "Reseeded")


def test_a_module_holding_its_own_generators_replays_each_call_alone_in_verify_and_in_a_bundle(tmp_path: Path) -> None:
    """A noise layer that draws from a generator it holds (a torch.Generator, a numpy Generator, a
    RandomState, a bit generator alone; on the step's module or a submodule; replaced between calls)
    replayed a later call with the generator's state as rebuilt (a numpy one's: its seed's, a MISMATCH
    in verify and from a bundle): each call's state is recorded, and a replay of any call alone, forward
    and backward, in verify and from a bundle, draws the recorded call's numbers."""
    (tmp_path / "noisy.py").write_text(_HELD_SCRIPT)
    made = python("noisy.py", "run.zarr", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    rec = replayer.open(tmp_path / "run.zarr")
    assert {"module:gen"} <= set(rec.step("NoisyGate@iter=3").rng)
    assert {"module:rs", "module:bits"} <= set(rec.step("Legacy@iter=3").rng)
    assert "module:inner.gen" in rec.step("Outer@iter=1").rng
    for name in _HELD_STEPS:
        first, later = rec.step(f"{name}@iter=0"), rec.step(f"{name}@iter=3")
        assert not bits_equal(first.tensor("output"), later.tensor("output"))  # each call drew other numbers
        for step in (later, first):  # the later call first: alone, not after the calls before it
            res = replayer.replay(rec, step.index)
            assert res.match and res.compared, (name, step.index, res.warnings)
            assert bits_equal(res.values["output"], step.tensor("output"))
            backward = next(s for s in rec.steps if s.forward == step.index and s.phase == "backward")
            back = replayer.replay(rec, backward.index)  # its forward again, with the call's noise
            assert back.match and back.compared, (name, back.warnings)
    whole = pdbg_here("verify", "run.zarr", cwd=tmp_path)
    assert whole.returncode == 0 and "40 of 40 steps replayed bit for bit (100.0%)" in whole.stdout, whole.stdout
    for name in ("NoisyNp", "Outer"):
        bundled = pdbg("bundle", "run.zarr", f"{name}@iter=3", "-o", f"{name}.pdbg", "--verify", cwd=tmp_path)
        assert bundled.returncode == 0 and "verified: the bundle replays bit for bit" in bundled.stdout, \
            bundled.stdout + bundled.stderr


class _HeldNoise(nn.Module):
    """A noisy linear layer holding a numpy Generator (not a paper step: annotated, so no constructor
    arguments are recorded and a replay rebuilds it from its skeleton alone)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.rng = np.random.default_rng(11)
        self.gen = torch.Generator().manual_seed(12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        noise = torch.from_numpy(self.rng.standard_normal(x.shape).astype(np.float32))
        return self.lin(x) * (1 + 0.1 * noise) + 0.01 * torch.randn(x.shape, generator=self.gen)


def test_a_module_generator_replays_rebuilt_from_its_skeleton_and_under_an_edit(run_path: Path) -> None:
    """An annotated module holding a numpy Generator, whose constructor arguments are not recorded, could
    not be rebuilt (the generator was no data): it is made again in the recorded call's state, for either
    call of a pass and for its backward. An edit reruns the call with the recorded call's noise; the
    caller's generators are given back after."""
    layer = recorder.annotate(_HeldNoise(), "Eq. 45")
    with recorder.record(run_path) as run:
        for _ in range(3):
            x = torch.randn(2, 6)
            (layer(x) + layer(x + 1)).sum().backward()  # two calls in each backward pass
            run.next_iteration()
    rec = replayer.open(run_path)
    # (a skeleton holds it as a $rng since schema 1.23, as state a replay sets at each call: before, unrecorded)
    assert "rng" not in (rec.step(0)._doc("module").get("unrecorded") or {})
    before = (layer.rng.bit_generator.state, layer.gen.get_state(), torch.get_rng_state(), np.random.get_state()[1])
    for step in (rec.step("Eq. 45@iter=2#1"), rec.step("Eq. 45@iter=0")):
        res = replayer.replay(rec, step.index)
        assert res.match and bits_equal(res.values["output"], step.tensor("output")), res.warnings
        assert set(res.rebuilt.values()) == {"skeleton"}, res.rebuilt
    backward = next(s for s in rec.steps if s.phase == "backward" and s.forward == rec.step("Eq. 45@iter=2").index)
    res = replayer.replay(rec, backward.index)
    assert res.match and res.compared, res.warnings
    step = rec.step("Eq. 45@iter=2")
    edited = replayer.replay(rec, step.index, edit={"args.0": "x * 0"})
    state = step.rng
    rng = snapshot.made_rng(state["module:rng"])
    gen = snapshot.made_rng(state["module:gen"])
    noise = torch.from_numpy(rng.standard_normal((2, 6)).astype(np.float32))
    bias = step.tensor("lin.bias", "param")
    expected = bias.expand(2, 6) * (1 + 0.1 * noise) + 0.01 * torch.randn((2, 6), generator=gen)
    assert bits_equal(edited.values["output"], expected)
    after = (layer.rng.bit_generator.state, layer.gen.get_state(), torch.get_rng_state(), np.random.get_state()[1])
    assert after[0] == before[0] and torch.equal(after[1], before[1]) and torch.equal(after[2], before[2])
    assert np.array_equal(after[3], before[3])


@recorder.paper_step("Eq. 46", description="multiplicative noise from the module's own torch.Generator")
class _GateHeld(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gen = torch.Generator().manual_seed(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (1 + 0.1 * torch.randn(x.shape, generator=self.gen))


@recorder.paper_step("Eq. 47", description="multiplicative noise from the module's own numpy Generator")
class _NpHeld(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rng = np.random.default_rng(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.from_numpy(1 + 0.1 * self.rng.standard_normal(x.shape).astype(np.float32))


def test_a_recording_of_schema_1_16_of_modules_holding_generators_replays_as_before(
        run_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 1.16 recording held a module's torch.Generator in its skeleton, built again at each call whose
    state differed, and no numpy Generator's state: its torch ones still replay from the skeleton; a
    numpy one's later call differs as before, and the warning names the generator and the older schema
    instead of its constants."""
    from recorder import skeleton
    from tests.sealing import as_schema

    plain_key = skeleton.state_key
    monkeypatch.setattr(snapshot, "find_module_rngs", lambda module: ())  # as 1.16 recorded: no such parts
    monkeypatch.setattr(skeleton, "state_key", lambda m: (plain_key(m), *(  # a generator by its state
        bytes(g.get_state().numpy()) for sub in m.modules() for g in vars(sub).values() if type(g) is torch.Generator)))
    gate, noisy = _GateHeld(), _NpHeld()
    with recorder.record(run_path) as run:
        for _ in range(4):
            x = torch.randn(3, 5)
            gate(x), noisy(x)
            run.next_iteration()
    monkeypatch.undo()
    as_schema(run_path, "1.16")
    rec = replayer.open(run_path)
    assert not any(part.startswith("module:") for s in rec.steps for part in s.rng)
    for it in (3, 0):
        res = replayer.replay(rec, f"Eq. 46@iter={it}")
        assert res.match, res.warnings
    assert replayer.replay(rec, "Eq. 47@iter=0").match
    res = replayer.replay(rec, "Eq. 47@iter=3")
    assert not res.match
    held = [w for w in res.warnings if w.startswith("the step's module held the generator rng (numpy Generator)")]
    assert held and "before schema 1.17 do not hold (this one is 1.16)" in held[0] and "record it again" in held[0], \
        res.warnings


_STE_SCRIPT = '''"""Binary activations whose straight-through estimator a flag picks: main() rebinds the global STE."""
import sys
import torch
import recorder


class SignSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.sign(x)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output


class SmoothSTE(SignSTE):
    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        return grad_output * torch.sqrt(1 - x * x)  # NaN where |x| > 1


STES = {"plain": SignSTE, "smooth": SmoothSTE}
STE = SignSTE


def act(x):  # a helper the module step calls: the global is found through it
    return STE.apply(x)


@recorder.paper_step("Eq. 1")
def binarize(x):
    return STE.apply(x)


@recorder.paper_step("Eq. 2")
class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return act(self.lin(x))


def made_here():
    class LocalSTE(SmoothSTE):
        pass
    return LocalSTE


def main():
    global STE
    STE = made_here() if sys.argv[2] == "local" else STES[sys.argv[2]]
    torch.manual_seed(0)
    block = Block()
    with recorder.record(sys.argv[1]) as run:
        for _ in range(2):
            x = (torch.randn(16, 8) * 2).requires_grad_()
            (binarize(x).sum() + block(x).sum()).backward()
            run.next_iteration()


if __name__ == "__main__":
    main()
'''


def test_a_step_reading_a_global_class_main_rebinds_replays_the_recorded_class(tmp_path: Path) -> None:
    """A step whose code reads a module-level global that the script's main() rebinds (STE = STES[args.ste])
    replays with what the global was bound to when recorded, not with what loading the script binds (main
    does not run in a replay): a replay in a fresh process matches bit for bit (the recorded NaN too) and
    says what it bound, through a helper of a module step as well; verify and a bundle agree."""
    (tmp_path / "bnn.py").write_text(_STE_SCRIPT)
    made = python("bnn.py", "run.zarr", "smooth", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    rec = replayer.open(tmp_path / "run.zarr")
    assert rec.step("binarize@iter=0").definition["globals"] == {"STE": "__main__:SmoothSTE"}
    assert rec.step("Block@iter=0").definition["globals"] == {"STE": "__main__:SmoothSTE"}
    assert rec.step("binarize@iter=0:backward").tensor("args.0").isnan().any()
    res = pdbg("replay", "run.zarr", "binarize@iter=0:backward", cwd=tmp_path)
    assert res.returncode == 0 and "MATCH: bit for bit" in res.stdout, res.stdout + res.stderr
    assert ("the module-level STE was __main__:SmoothSTE when recorded (the training script rebound it as it ran); "
            "loading the code binds it to __main__:SignSTE: replayed with __main__:SmoothSTE, as recorded"
            ) in res.stdout
    whole = pdbg("verify", "run.zarr", cwd=tmp_path)
    assert whole.returncode == 0 and "8 of 8 steps replayed bit for bit (100.0%)" in whole.stdout, whole.stdout
    bundled = pdbg("bundle", "run.zarr", "Block@iter=1:backward", "-o", "b.pdbg", "--verify", cwd=tmp_path)
    assert bundled.returncode == 0 and "verified: the bundle replays bit for bit" in bundled.stdout, \
        bundled.stdout + bundled.stderr


def test_a_global_bound_to_a_class_a_replay_cannot_import_is_named_as_the_likely_cause(tmp_path: Path) -> None:
    """Where main() bound the global to a class made inside a function, which a replay cannot import, the
    replay runs what loading the script binds and its warning names the recorded class as the likely cause."""
    (tmp_path / "bnn.py").write_text(_STE_SCRIPT)
    made = python("bnn.py", "run.zarr", "local", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    res = pdbg("replay", "run.zarr", "binarize@iter=0:backward", cwd=tmp_path)
    assert "MISMATCH" in res.stdout, res.stdout + res.stderr
    warning = next((line for line in res.stdout.splitlines() if "__main__:made_here.<locals>.LocalSTE" in line), "")
    assert warning.startswith("warning: the module-level STE was __main__:made_here.<locals>.LocalSTE when "
                              "recorded, which a replay cannot bind again") and \
        "loading the code binds it to __main__:SignSTE, which the replay ran (a likely cause" in warning, res.stdout


class _PlainSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return torch.sign(x)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> torch.Tensor:
        return grad_output


class _ScaledSTE(_PlainSTE):
    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> torch.Tensor:
        return grad_output * 0.5


_STE = _PlainSTE


@recorder.paper_step("Eq. 33", description="sign with the straight-through estimator the global _STE names")
def ste_sign(x: torch.Tensor) -> torch.Tensor:
    return _STE.apply(x)


def test_a_global_rebound_during_the_run_is_recorded_per_call_and_given_back_after_a_replay(run_path: Path) -> None:
    """A global the training rebinds between calls (a schedule of estimators) is noted again at the call
    that finds it rebound: each call's replay runs the class it ran, and the caller's binding (a notebook's
    own module) is what it was after every replay."""
    global _STE  # noqa: PLW0603 - rebound as training code does
    try:
        with recorder.record(run_path) as run:
            for ste in (_PlainSTE, _ScaledSTE, _PlainSTE):
                _STE = ste
                x = torch.randn(8, requires_grad=True)
                ste_sign(x).sum().backward()
                run.next_iteration()
        rec = replayer.open(run_path)
        assert [rec.step(f"ste_sign@iter={i}").definition.get("globals") for i in range(3)] == \
            [{"_STE": f"{__name__}:_PlainSTE"}, {"_STE": f"{__name__}:_ScaledSTE"}, {"_STE": f"{__name__}:_PlainSTE"}]
        _STE = _ScaledSTE
        for i in range(3):
            res = replayer.replay(rec, f"ste_sign@iter={i}:backward")
            assert res.match and bits_equal(res.values["args.0"], rec.step(f"ste_sign@iter={i}:backward")
                                            .tensor("args.0")), (i, res.warnings)
            assert any(w.startswith("the module-level _STE was") for w in res.warnings) == (i != 1), res.warnings
            assert _STE is _ScaledSTE
    finally:
        _STE = _PlainSTE


def test_a_recorded_binding_names_only_torch_math_or_the_training_codes_own() -> None:
    """A recording from elsewhere can name what a module-level global was bound to: a replay binds it
    (and the step's code then calls it) only where it is torch's tensor math or module, or the training
    code's own class or function, never os.system, torch.load or another installed package's."""
    import os

    import numpy as np

    from recorder.jsonval import may_bind as _bindable

    assert [_bindable(obj) for obj in (os.system, torch.load, np.load, np.ndarray, subprocess.Popen)] == [False] * 5
    assert all(_bindable(obj) for obj in (torch.tanh, torch.nn.functional.gelu, torch.nn.Linear, Critic))


@recorder.paper_step("Eq. 42", description="a matching in numpy")
def np_matching(cost: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    c = cost.detach().numpy()
    return c.argmin(0).astype(np.int64), np.arange(c.shape[1], dtype=np.int64)


def test_a_step_returning_numpy_values_replays_as_compared(tmp_path: Path) -> None:
    """A step that returns numpy arrays is compared by their dtype, shape and bytes: its correct replay
    is a match (not "nothing compared"), a changed one a mismatch with the largest difference."""
    torch.manual_seed(0)
    with recorder.record(tmp_path / "run.zarr"):
        np_matching(torch.randn(4, 3))
    rec = replayer.open(tmp_path / "run.zarr")
    result = replayer.replay(rec, rec.step(0))
    assert result.compared and result.match
    assert [(d.name, d.match) for d in result.outputs] == [("output structure", True)]
    edited = replayer.replay(rec, rec.step(0), edit={"args.0": "-x"})
    assert edited.compared and not edited.match
    assert edited.outputs[0].max_ulp is None and "max abs difference" in (edited.outputs[0].reason or "")


@recorder.paper_step("Eq. 43", description="self-attention: its argument as query, key and value")
def self_attention(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x @ x.transpose(-1, -2) / 4, -1) @ x


@recorder.paper_step("Eq. 44", description="a residual around self-attention")
def residual_attention(x: torch.Tensor) -> torch.Tensor:
    return x + self_attention(x)


@recorder.paper_step("Eq. 45", description="a polynomial: its argument used eight times")
def polynomial(x: torch.Tensor) -> torch.Tensor:
    return x * 0.5 + x * x * 0.25 + x.exp() * x + x.sin() + x.tanh() * x + x.cos()


@recorder.paper_step("Eq. 46", description="a residual around the polynomial")
def residual_polynomial(x: torch.Tensor) -> torch.Tensor:
    return x + polynomial(x)


def _record_residual(path: Path, step: Any) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(16, 16)
    with recorder.record(path, model=lin, mode="full"), torch.autocast("cpu", dtype=torch.bfloat16):
        h = lin(torch.randn(4, 8, 16))
        (step(h) * h).float().square().mean().backward()


def _sum_the_uses(monkeypatch: pytest.MonkeyPatch) -> None:
    from recorder import taps

    monkeypatch.setattr(taps, "pass_apart", lambda tapped: None)
    monkeypatch.setattr(taps, "order_uses", lambda roots: None)


def _four_uses_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    from recorder import taps

    monkeypatch.setattr(taps, "_SPARES", taps.SPARES_BEFORE)


@pytest.mark.parametrize(("step", "older", "schema"), [(residual_attention, _sum_the_uses, "1.20"),
                                                       (residual_polynomial, _four_uses_apart, "1.21")],
                         ids=["uses-summed-before-1.21", "four-uses-apart-before-1.22"])
def test_a_recording_of_an_older_tap_replays_as_recorded(tmp_path: Path, monkeypatch, step, older, schema) -> None:
    """Since schema 1.21 a step's taps pass each use of an argument on apart (the attention given x three
    times), as autograd adds them unrecorded; before, their sum. Since 1.22 up to 16 uses (the polynomial's
    eight); 1.21 passed 4 on apart and summed the others. The residual step around each recorded the bits its
    recorder's way gave its grad input. A replay passes the inner step's uses on as its recorder did: each
    recording replays bit for bit, and an older one replayed the newer way would not."""
    from tests.sealing import as_schema

    _record_residual(tmp_path / "new.zarr", step)
    older(monkeypatch)  # (the recorder of the schema before)
    _record_residual(tmp_path / "old.zarr", step)
    monkeypatch.undo()
    shutil.copytree(tmp_path / "old.zarr", tmp_path / "old-stamped.zarr")
    as_schema(tmp_path / "old-stamped.zarr", schema)
    for name, matches in (("new", True), ("old-stamped", True), ("old", False)):
        with replayer.open(tmp_path / f"{name}.zarr") as rec:
            back = rec.steps.filter(name=step.__name__, phase="backward")[0]
            result = replayer.replay(rec, back.index)
            assert result.match is matches, (name, [d.summary() for d in result.outputs])
            assert all(inner.match for inner in result.inner), name


@recorder.paper_step("Eq. 51", description="a linear map whose result the caller takes the sign of")
def signed_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w


@recorder.paper_step("Eq. 52", description="a gate by the sign of its input")
def sign_gate(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.sgn() * w


def test_zero_tensor_gradients_are_recorded_and_replayed_as_zeros(run_path: Path) -> None:
    """sgn's backward passes on a ZeroTensor, which has no memory: the recorder recorded the grad output it
    sent into a step from whatever lay at its data pointer, and a replay compared such a grad input it computed
    the same way, a MISMATCH of garbage; both are the zeros they stand for, and the steps replay bit for bit."""
    torch.manual_seed(0)
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    with recorder.record(run_path):
        signed_linear(x * 1, w).sgn().sum().backward()  # its grad output: a ZeroTensor
        sign_gate(x * 1, torch.randn(4, 8, requires_grad=True)).sum().backward()  # its grad input args.0: one
    rec = replayer.open(run_path)
    for name, tensor in (("signed_linear", "output"), ("sign_gate", "args.0")):
        step = rec.step(f"{name}:backward")
        recorded = step.tensor(tensor)
        assert bits_equal(recorded, torch.zeros_like(recorded)), (name, recorded)
        res = replayer.replay(rec, step.index)
        assert res.match, (name, [(d.name, d.max_abs) for d in res.outputs])


def test_a_step_that_raised_replays_with_the_steps_inside_it_compared(tmp_path: Path) -> None:
    """A step whose inner step's NaN check raised: its replay raised the same exception and said MATCH with no
    word of the steps inside it (the one that computed before the raise, the one that raised), as if they had not
    run. They are compared as in a step that returned: the first by its output, the one that raised by its
    exception's type; an inner step whose recorded call raised where the replayed one raised another, or none,
    does not match."""
    from tests.replayer.test_bisect import checked_update

    path = tmp_path / "run.zarr"
    torch.manual_seed(0)
    with pytest.raises(FloatingPointError), recorder.record(path):
        checked_update(torch.randn(6, requires_grad=True))
    rec = replayer.open(path)
    outer = rec.step("checked_update")
    res = replayer.replay(rec, outer)
    assert res.match and res.exception is not None and res.exception.startswith("FloatingPointError")
    assert [(s.step.name, s.match) for s in res.inner] == [("checked_root", True)]
    assert res.inner[0].reason == "raised FloatingPointError, as recorded"
    done = pdbg_here("replay", str(path), str(outer.index), cwd=tmp_path)
    assert done.returncode == 0 and "inner steps: 1 of 1 match" in done.stdout, done.stdout
    # (the check's step given a finite input now: it returns, where its recorded call raised)
    res = replayer.replay(rec, outer, edit={"checked_root/args.0": "x.abs()"})
    root = [s for s in res.inner if s.step.name == "checked_root"]
    assert not res.match and root and not root[0].match, res.inner
