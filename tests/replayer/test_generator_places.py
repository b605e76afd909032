"""Generators a step draws from without being given them: a parameter's default, a module-level dict
or config object, a dict its module holds. Each call replays alone bit for bit, in any order, and a
seed reseeds a torch.Generator passed as an argument."""

from __future__ import annotations

import random
import types
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

import recorder
import replayer
from recorder import jsonval
from tests.cli import pdbg_here, python
from tests.replays import assert_each_call_replays_alone, bits

G_DEFAULT = torch.Generator().manual_seed(42)
RNGS = {"aug": torch.Generator().manual_seed(5), "np": np.random.default_rng(5)}
CFG = types.SimpleNamespace(rng=torch.Generator().manual_seed(6), scale=0.5)
LATE: dict[str, torch.Generator] = {}  # filled as a script's main() fills it
LISTED = [torch.Generator().manual_seed(7)]



@recorder.paper_step("noise (default)")
def noise_default(x: torch.Tensor, generator: torch.Generator = G_DEFAULT) -> torch.Tensor:
    return x + torch.randn(x.shape, generator=generator)


@recorder.paper_step("noise (keyword default)")
def noise_keyword(x: torch.Tensor, *, scale: float = 1.0, generator: torch.Generator = G_DEFAULT) -> torch.Tensor:
    return x + scale * torch.rand(x.shape, generator=generator)


@recorder.paper_step("noise (dict)")
def noise_dict(x: torch.Tensor) -> torch.Tensor:
    extra = torch.from_numpy(RNGS["np"].standard_normal(x.shape).astype(np.float32))
    return x + torch.randn(x.shape, generator=RNGS["aug"]) + extra


@recorder.paper_step("noise (config)")
def noise_config(x: torch.Tensor) -> torch.Tensor:
    return x + CFG.scale * torch.randn(x.shape, generator=CFG.rng)


@recorder.paper_step("noise layer (dict)")
class NoiseDict(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gens = {"z": torch.Generator().manual_seed(3)}

    def forward(self, x: torch.Tensor, generator: torch.Generator = G_DEFAULT) -> torch.Tensor:
        return x + torch.randn(x.shape, generator=self.gens["z"]) + torch.rand(x.shape, generator=generator)


@recorder.paper_step("sample x_T")
def sample(n: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(n, 4, generator=generator)


def _record(path: Path) -> None:
    layer = NoiseDict()
    g = torch.Generator().manual_seed(1234)
    with recorder.record(path) as run:
        for _ in range(3):
            x = torch.ones(2, 4)
            noise_config(noise_dict(noise_keyword(noise_default(x), scale=2.0)))
            layer(x)
            sample(2, generator=g)
            run.next_iteration()


NAMES = ("noise (default)", "noise (keyword default)", "noise (dict)", "noise (config)", "noise layer (dict)")


def test_each_call_replays_alone_in_any_order(tmp_path: Path) -> None:
    """The third call of each step first, then the others backwards: every one bit for bit (a replay in
    recording order drew from the generators' state as loading left them, and matched only in order)."""
    path = tmp_path / "run.zarr"
    _record(path)
    assert_each_call_replays_alone(path, NAMES)


def test_the_generators_are_recorded_and_the_callers_are_left_as_they_were(tmp_path: Path) -> None:
    """A default taken is recorded as the argument it was; the states of the held ones are parts of the
    step's RNG document; replays leave the live generators where training left them."""
    path = tmp_path / "run.zarr"
    before = [g.get_state() for g in (G_DEFAULT, RNGS["aug"], CFG.rng)]
    _record(path)
    after = [g.get_state() for g in (G_DEFAULT, RNGS["aug"], CFG.rng)]
    rec = replayer.open(path)
    assert "generator" in rec.step("noise (default)@iter=1").arguments["kwargs"]
    assert {"global:RNGS['aug']", "global:RNGS['np']"} <= set(rec.step("noise (dict)@iter=1").rng)
    assert "global:CFG.rng" in rec.step("noise (config)@iter=1").rng
    assert "module:gens['z']" in rec.step("noise layer (dict)@iter=1").rng
    for name in NAMES:
        replayer.replay(rec, f"{name}@iter=2")
    assert all(torch.equal(a, g.get_state()) for a, g in zip(after, (G_DEFAULT, RNGS["aug"], CFG.rng)))
    assert not torch.equal(before[0], after[0])


def test_verify_of_a_sample_matches(tmp_path: Path) -> None:
    """pdbg verify --sample replays a subset, out of the recording's order: every step still matches."""
    path = tmp_path / "run.zarr"
    _record(path)
    res = pdbg_here("verify", str(path), "--sample", "3", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr


def test_a_seed_reseeds_a_generator_passed_as_an_argument(tmp_path: Path) -> None:
    """A step drawing only from its generator argument changes under a seed, the same for the same seed
    (it said NO CHANGE: the generator kept its recorded state)."""
    path = tmp_path / "run.zarr"
    _record(path)
    rec = replayer.open(path)
    assert replayer.replay(rec, "sample x_T@iter=1").match
    a, b = (replayer.replay(rec, "sample x_T@iter=1", seed=3) for _ in range(2))
    assert not a.match and torch.equal(bits(a.values["output"]), bits(b.values["output"]))
    expected = torch.randn(2, 4, generator=torch.Generator().manual_seed(3))
    assert torch.equal(bits(a.values["output"]), bits(expected))


def test_a_generator_argument_of_an_older_recording_is_refused_with_advice() -> None:
    """A random.Random or numpy Generator argument that a recording before 1.23 held as $opaque is named as a
    generator, with what to do: record again."""
    for value, named in ((random.Random(0), "random.Random"), (np.random.default_rng(0), "numpy Generator")):
        reason = jsonval.opaque_reason(jsonval.Opaque(jsonval.type_ref(value), repr(value)))
        assert reason is not None and f"{named} passed as an argument" in reason, named
        assert "before schema 1.23" in reason and "record again" in reason, named


@recorder.paper_step("noise (filled by main)")
def noise_late(x: torch.Tensor) -> torch.Tensor:
    return x + torch.randn(x.shape, generator=LATE["z"])


@recorder.paper_step("noise (list)")
def noise_listed(x: torch.Tensor) -> torch.Tensor:
    return x + torch.randn(x.shape, generator=LISTED[0])


def test_a_dict_item_main_made_is_made_again_for_a_replay(tmp_path: Path) -> None:
    """A module-level dict empty at import, filled by the script's main(): the replay makes the generator in
    its recorded state, puts it in the dict for the call, and empties it again after."""
    path = tmp_path / "run.zarr"
    LATE["z"] = torch.Generator().manual_seed(11)
    try:
        with recorder.record(path) as run:
            for _ in range(3):
                noise_late(torch.ones(2, 4))
                run.next_iteration()
    finally:
        LATE.clear()
    rec = replayer.open(path)
    step = rec.step("noise (filled by main)@iter=2")
    res = replayer.replay(rec, step.index)
    assert res.match and torch.equal(bits(res.values["output"]), bits(step.tensor("output"))), res.warnings
    assert any("LATE['z']" in w for w in res.warnings) and LATE == {}


def test_a_generator_where_the_recorder_does_not_look_is_warned_of_at_record_time(tmp_path: Path) -> None:
    """A generator in a module-level list: its state is not recorded, and the recording says so once."""
    with warnings.catch_warnings(record=True) as caught, recorder.record(tmp_path / "run.zarr"):
        warnings.simplefilter("always")
        for _ in range(2):
            noise_listed(torch.ones(2, 4))
    said = [str(w.message) for w in caught if "LISTED[0] (torch Generator)" in str(w.message)]
    assert len(said) == 1 and "a replay of a later call alone will draw other numbers" in said[0]


LISTED_SCRIPT = """
import sys
import torch
import recorder

GENS = [torch.Generator().manual_seed(1)]


@recorder.paper_step("noise (list)")
def noise_listed(x):
    return x + torch.randn(x.shape, generator=GENS[0])


if __name__ == "__main__":
    with recorder.record(sys.argv[1]) as run:
        for _ in range(2):
            noise_listed(torch.ones(2, 4))
            run.next_iteration()
"""


def test_verify_does_not_count_a_match_in_order_only_as_bit_for_bit(tmp_path: Path) -> None:
    """A step drawing from a generator in a module-level list matches only as verify replays it, in order:
    verify lists it apart and exits 1 (it said 100% bit for bit, while a replay of a later call alone differs)."""
    (tmp_path / "train.py").write_text(LISTED_SCRIPT)
    made = python("train.py", "run.zarr", cwd=tmp_path)
    assert made.returncode == 0 and "GENS[0] (torch Generator)" in made.stderr, made.stderr
    res = pdbg_here("verify", "run.zarr", cwd=tmp_path)
    assert res.returncode == 1 and "0 of 2 steps replayed bit for bit" in res.stdout, res.stdout + res.stderr
    assert "matched only as replayed here, in recording order" in res.stdout and "GENS[0]" in res.stdout
