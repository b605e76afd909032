"""What a step takes from its parameters' defaults: a module-level tensor that training changes in place, a
numpy Generator or a random.Random drawn from at every call. Each call replays alone bit for bit, in any
order, and recording leaves training as it was."""

from __future__ import annotations

import contextlib
import random
from pathlib import Path

import numpy as np
import torch
from torch import nn

import recorder
import replayer
from recorder import snapshot
from tests.cli import pdbg_here
from tests.replays import assert_each_call_replays_alone, bits

BIAS = torch.zeros(4)  # changed in place between the calls, as training changes a running statistic
NP_RNG = np.random.default_rng(5)
PY_RNG = random.Random(6)



@recorder.paper_step("add bias")
def add_bias(x: torch.Tensor, bias: torch.Tensor = BIAS) -> torch.Tensor:
    return x + bias


@recorder.paper_step("add bias (no_grad)")
@torch.no_grad()
def add_bias_no_grad(x: torch.Tensor, bias: torch.Tensor = BIAS) -> torch.Tensor:
    return x + bias


@recorder.paper_step("scale")
def scale(x: torch.Tensor, s: torch.Tensor = torch.tensor(2.0)) -> torch.Tensor:  # noqa: B008 - the default is the case
    return x * s


@recorder.paper_step("jitter (numpy)")
def jitter(x: torch.Tensor, rng: np.random.Generator = NP_RNG) -> torch.Tensor:
    return x + torch.from_numpy(rng.standard_normal(x.shape).astype(np.float32))


@recorder.paper_step("jitter (random)")
def jitter_py(x: torch.Tensor, *, rng: random.Random = PY_RNG) -> torch.Tensor:
    return x * rng.random()


@recorder.paper_step("plain")
def plain(x: torch.Tensor, k: float = 0.5) -> torch.Tensor:
    return x * k


class Shift(nn.Module):
    def forward(self, x: torch.Tensor, bias: torch.Tensor = BIAS) -> torch.Tensor:
        return x - bias


def _train(path: Path | None) -> list[torch.Tensor]:
    """Three iterations from a fixed start, recorded where ``path`` is given; every step's result."""
    BIAS.zero_()
    NP_RNG.bit_generator.state = np.random.default_rng(5).bit_generator.state
    PY_RNG.seed(6)
    shift = recorder.annotate(Shift(), "Eq. 2", name="shift")
    out = []
    with recorder.record(path) if path is not None else contextlib.nullcontext() as run:
        for _ in range(3):
            x = torch.ones(2, 4)
            out += [add_bias(x), add_bias_no_grad(x), scale(x), jitter(x), jitter_py(x), plain(x), shift(x)]
            BIAS.add_(torch.linspace(0.1, 0.4, 4))
            if run is not None:
                run.next_iteration()
    return out


NAMES = ("add bias", "add bias (no_grad)", "scale", "jitter (numpy)", "jitter (random)", "plain", "shift")


def test_each_call_replays_alone_in_any_order(tmp_path: Path) -> None:
    """The last call of each step first, then the others backwards: every one bit for bit (a tensor default
    behind torch.no_grad() or of an annotated module replayed with its value now, a numpy or random default
    drawn from in its state now: MISMATCH from the second call on)."""
    path = tmp_path / "run.zarr"
    _train(path)
    assert_each_call_replays_alone(path, NAMES)


def test_defaults_are_recorded_and_the_live_ones_left_as_they_were(tmp_path: Path) -> None:
    """A tensor default taken is an argument, its values those at the call; a numpy or random default's state
    is the step's RNG part default:<name>; replays leave the live defaults as training left them."""
    path = tmp_path / "run.zarr"
    _train(path)
    after = (BIAS.clone(), NP_RNG.bit_generator.state, PY_RNG.getstate())
    rec = replayer.open(path)
    for name in ("add bias", "add bias (no_grad)", "shift"):
        step = rec.step(f"{name}@iter=1")
        assert "bias" in step.arguments["kwargs"], name
        assert torch.equal(bits(step.tensor("kwargs.bias")), bits(torch.linspace(0.1, 0.4, 4))), name
    assert "s" in rec.step("scale@iter=1").arguments["kwargs"]
    assert "default:rng" in rec.step("jitter (numpy)@iter=1").rng
    assert "default:rng" in rec.step("jitter (random)@iter=1").rng
    for name in NAMES:
        replayer.replay(rec, f"{name}@iter=0")
    assert torch.equal(bits(BIAS), bits(after[0]))
    assert NP_RNG.bit_generator.state == after[1] and PY_RNG.getstate() == after[2]


def test_a_step_without_such_defaults_records_what_it_did(tmp_path: Path) -> None:
    """A step whose defaults are no tensor or generator: looked through once (nothing found, nothing done at a
    call), its arguments and RNG parts as before."""
    path = tmp_path / "run.zarr"
    _train(path)
    assert plain.__pdbg_step__.defaults == ()
    step = replayer.open(path).step("plain@iter=1")
    assert list(step.arguments["kwargs"]) == [] and not any(p.startswith("default:") for p in step.rng)
    assert snapshot.step_defaults(plain.__pdbg_step__.target) == ()


def test_a_default_the_call_overrides_is_not_taken() -> None:
    """Passed by keyword or by position, a parameter's default is not what the call computes with: not taken."""
    found = snapshot.step_defaults(jitter.__pdbg_step__.target)
    x, g = torch.ones(2), np.random.default_rng(1)
    assert [name for _, name, *_ in found] == ["rng"]
    assert snapshot.defaults_taken(found, (x,), {}) == {"rng": NP_RNG}
    assert snapshot.defaults_taken(found, (x, g), {}) == {} and snapshot.defaults_taken(found, (x,), {"rng": g}) == {}


def test_recording_changes_nothing_in_training(tmp_path: Path) -> None:
    """The same results, bit for bit, with and without recording, and the defaults end where they did."""
    bare = _train(None)
    ends = (BIAS.clone(), NP_RNG.bit_generator.state, PY_RNG.getstate())
    recorded = _train(tmp_path / "run.zarr")
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(bare, recorded, strict=True))
    assert torch.equal(bits(BIAS), bits(ends[0]))
    assert NP_RNG.bit_generator.state == ends[1] and PY_RNG.getstate() == ends[2]


def test_verify_in_a_fresh_process_matches_every_step(tmp_path: Path) -> None:
    """pdbg verify, which imports this module again (BIAS zeros, the generators as seeded), replays every
    step bit for bit."""
    path = tmp_path / "run.zarr"
    _train(path)
    res = pdbg_here("verify", str(path), cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr


@recorder.paper_step("add bias (positional-only)")
def add_bias_positional(x: torch.Tensor, bias: torch.Tensor = BIAS, /) -> torch.Tensor:
    return x + bias


@recorder.paper_step("blend (positional-only)")
def blend(x: torch.Tensor, k: float = 0.5, rng: np.random.Generator = NP_RNG, bias: torch.Tensor = BIAS, /,
          scale: float = 1.0) -> torch.Tensor:
    return (x * k + bias) * scale + float(rng.standard_normal())


@recorder.paper_step("noisy (positional-only)")
def noisy(x: torch.Tensor, bias: torch.Tensor = BIAS, rng: np.random.Generator = NP_RNG, /) -> torch.Tensor:
    return x + bias + float(rng.standard_normal())


class ShiftPositional(nn.Module):
    def forward(self, x: torch.Tensor, bias: torch.Tensor = BIAS, /) -> torch.Tensor:
        return x - bias


POSITIONAL = ("add bias (positional-only)", "blend (positional-only)", "noisy (positional-only)", "shift (positional)")


def _train_positional(path: Path | None) -> list[torch.Tensor]:
    """Three iterations of the steps with positional-only defaults, from a fixed start; every step's result."""
    BIAS.zero_()
    NP_RNG.bit_generator.state = np.random.default_rng(5).bit_generator.state
    shift = recorder.annotate(ShiftPositional(), "Eq. 3", name="shift (positional)")
    out = []
    with recorder.record(path) if path is not None else contextlib.nullcontext() as run:
        for i in range(3):
            x = torch.ones(2, 4)
            out += [add_bias_positional(x), blend(x, scale=2.0) if i != 1 else blend(x, 0.25), noisy(x), shift(x)]
            BIAS.add_(torch.linspace(0.1, 0.4, 4))
            if run is not None:
                run.next_iteration()
    return out


class TestPositionalOnlyDefaults:
    def test_each_call_replays_alone_in_any_order(self, tmp_path: Path) -> None:
        """A tensor default of a positional-only parameter: recorded (it was not, and a replay ran with the
        tensor's value now, MISMATCH from the second call on), so every call replays alone bit for bit."""
        path = tmp_path / "run.zarr"
        _train_positional(path)
        assert_each_call_replays_alone(path, POSITIONAL)

    def test_they_are_recorded_by_position_with_the_defaults_before_them(self, tmp_path: Path) -> None:
        """Appended to the recorded args, the positional-only defaults before them too (a float, a numpy
        Generator as $rng), never in kwargs, where a replay would pass them by keyword; a generator default
        after the last tensor stays the RNG part default:<name>."""
        path = tmp_path / "run.zarr"
        _train_positional(path)
        rec = replayer.open(path)
        want = torch.linspace(0.1, 0.4, 4)
        for name in ("add bias (positional-only)", "shift (positional)"):
            step = rec.step(f"{name}@iter=1")
            assert len(step.arguments["args"]) == 2 and step.arguments["kwargs"] == {}, name
            assert torch.equal(bits(step.tensor("args.1")), bits(want)), name
        first, second = (rec.step(f"blend (positional-only)@iter={i}").arguments for i in (0, 1))
        assert first["args"][1] == 0.5 and "$rng" in first["args"][2] and first["kwargs"] == {"scale": 2.0}
        assert second["args"][1] == 0.25 and len(second["args"]) == 4 and second["kwargs"] == {}
        assert not any(p.startswith("default:") for p in rec.step("blend (positional-only)@iter=1").rng)
        step = rec.step("noisy (positional-only)@iter=1")
        assert len(step.arguments["args"]) == 2 and "default:rng" in step.rng

    def test_a_call_passing_them_records_what_it_passed(self) -> None:
        """Passed by position, none is taken; a **kwargs key of the same name does not pass one."""
        found = snapshot.step_defaults(blend.__pdbg_step__.target)
        assert [(position, name, only) for position, name, _, only in found] == \
            [(1, "k", True), (2, "rng", True), (3, "bias", True)]
        x = torch.ones(2)
        assert snapshot.defaults_taken(found, (x, 1.0, NP_RNG, x), {}) == {}
        taken = snapshot.defaults_taken(found, (x, 1.0), {"k": 2.0})
        assert list(taken) == ["rng", "bias"]
        assert snapshot.defaults_apart(found, taken) == ([NP_RNG, BIAS], {}, {})
        assert snapshot.step_defaults(noisy.__pdbg_step__.target)[-1][1:] == ("rng", NP_RNG, True)

    def test_recording_changes_nothing_in_training(self, tmp_path: Path) -> None:
        """The same results, bit for bit, with and without recording, and the defaults end where they did."""
        bare = _train_positional(None)
        ends = (BIAS.clone(), NP_RNG.bit_generator.state)
        recorded = _train_positional(tmp_path / "run.zarr")
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(bare, recorded, strict=True))
        assert torch.equal(bits(BIAS), bits(ends[0])) and NP_RNG.bit_generator.state == ends[1]
