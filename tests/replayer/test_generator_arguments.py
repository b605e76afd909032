"""Numpy and Python generator objects passed to a step as arguments (RL and diffusion code's
``jitter(x, rng)``): recorded with their state at each call (``$rng``), so that each call replays alone bit
for bit, a seed reseeds them, and recording leaves training as it was."""

from __future__ import annotations

import base64
import contextlib
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import recorder
import replayer
from recorder import jsonval, snapshot
from recorder.errors import FormatError, UnknownTagError
from recorder.store import layout
from replayer.replay import known_refusal
from tests.cli import pdbg_here
from tests.replays import assert_each_call_replays_alone, bits
from tests.sealing import rewrite_docs


@recorder.paper_step("jitter (numpy Generator)")
def jitter(x: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
    return x + torch.from_numpy(rng.normal(size=tuple(x.shape))).float()


@recorder.paper_step("jitter (RandomState)")
def jitter_legacy(x: torch.Tensor, rng: np.random.RandomState) -> torch.Tensor:
    return x + torch.from_numpy(rng.standard_normal(tuple(x.shape))).float()


@recorder.paper_step("jitter (random.Random)")
def jitter_py(x: torch.Tensor, rng: random.Random) -> torch.Tensor:
    return x * rng.random() + rng.gauss(0.0, 1.0)  # gauss keeps every second value for the next call


@recorder.paper_step("jitter (in containers)")
def jitter_held(x: torch.Tensor, rngs: dict[str, Any], more: list[Any]) -> torch.Tensor:
    return x + float(rngs["np"].random()) * more[0].random() + float(more[1].standard_normal())


def _generators() -> tuple[np.random.Generator, np.random.RandomState, random.Random, np.random.Generator,
                           random.Random, np.random.RandomState]:
    return (np.random.default_rng(1), np.random.RandomState(2), random.Random(3), np.random.default_rng(4),
            random.Random(5), np.random.RandomState(6))


def _train(path: Path | None) -> tuple[list[torch.Tensor], tuple[Any, ...]]:
    """Three iterations from fixed seeds, recorded where ``path`` is given: every step's result, and the
    generators as training left them."""
    gen, legacy, py, held_np, held_py, held_legacy = rngs = _generators()
    out = []
    with recorder.record(path) if path is not None else contextlib.nullcontext() as run:
        for _ in range(3):
            x = torch.ones(2, 4)
            out += [jitter(x, gen), jitter_legacy(x, legacy), jitter_py(x, rng=py),
                    jitter_held(x, {"np": held_np}, [held_py, held_legacy])]
            if run is not None:
                run.next_iteration()
    return out, rngs


def _states(rngs: tuple[Any, ...]) -> list[Any]:
    return [snapshot.read_global_rng(g)[0] for g in rngs]


NAMES = ("jitter (numpy Generator)", "jitter (RandomState)", "jitter (random.Random)", "jitter (in containers)")


def test_each_call_replays_alone_in_any_order(tmp_path: Path) -> None:
    """The last call of each step first, then the others backwards: every one bit for bit (the generators
    were $opaque, and every replay was refused)."""
    path = tmp_path / "run.zarr"
    _train(path)
    assert_each_call_replays_alone(path, NAMES)


def test_the_states_are_recorded_and_the_callers_generators_left_as_they_were(tmp_path: Path) -> None:
    """Each generator argument is its kind and state at the call, in JSON; replays draw from new ones and
    leave the caller's where training left them."""
    path = tmp_path / "run.zarr"
    _, rngs = _train(path)
    after = _states(rngs)
    rec = replayer.open(path)
    assert layout.parse_version(rec.reader.schema_version) >= (1, 23)
    kinds = [rec.step(f"{name}@iter=1").arguments for name in NAMES[:3]]
    assert [a["args"][1]["$rng"]["kind"] for a in kinds[:2]] == ["numpy.random.Generator", "numpy.random.RandomState"]
    assert kinds[2]["kwargs"]["rng"]["$rng"]["kind"] == "random.Random"
    held = rec.step("jitter (in containers)@iter=1").arguments["args"]
    assert held[1]["np"]["$rng"]["kind"] == "numpy.random.Generator"
    assert [g["$rng"]["kind"] for g in held[2]] == ["random.Random", "numpy.random.RandomState"]
    first, later = (rec.step(f"jitter (numpy Generator)@iter={i}").arguments["args"][1] for i in (0, 2))
    assert first != later
    for name in NAMES:
        replayer.replay(rec, f"{name}@iter=1")
    assert _states(rngs) == after


def test_a_seed_reseeds_a_generator_passed_as_an_argument(tmp_path: Path) -> None:
    """A step drawing only from its generator argument changes under a seed, as a generator of its kind
    made with that seed draws, the same for the same seed."""
    path = tmp_path / "run.zarr"
    _train(path)
    rec = replayer.open(path)
    x = torch.ones(2, 4)
    expected = {"jitter (numpy Generator)": jitter.__wrapped__(x, np.random.default_rng(3)),
                "jitter (RandomState)": jitter_legacy.__wrapped__(x, np.random.RandomState(3)),
                "jitter (random.Random)": jitter_py.__wrapped__(x, random.Random(3))}
    for name, want in expected.items():
        a, b = (replayer.replay(rec, f"{name}@iter=1", seed=3) for _ in range(2))
        assert not a.match, name
        assert torch.equal(bits(a.values["output"]), bits(b.values["output"])), name
        assert torch.equal(bits(a.values["output"]), bits(want)), name
    held = replayer.replay(rec, "jitter (in containers)@iter=1", seed=3)
    want = jitter_held.__wrapped__(x, {"np": np.random.default_rng(3)}, [random.Random(3), np.random.RandomState(3)])
    assert torch.equal(bits(held.values["output"]), bits(want))


def test_recording_changes_nothing_in_training(tmp_path: Path) -> None:
    """The same results, bit for bit, with and without recording, and the generators end where they did."""
    bare, bare_rngs = _train(None)
    recorded, recorded_rngs = _train(tmp_path / "run.zarr")
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(bare, recorded, strict=True))
    assert _states(bare_rngs) == _states(recorded_rngs)


def test_verify_matches_every_step(tmp_path: Path) -> None:
    """pdbg verify replays every step bit for bit (each was refused as given an object that is not data)."""
    path = tmp_path / "run.zarr"
    _train(path)
    res = pdbg_here("verify", str(path), cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr


def test_what_cannot_be_made_again_stays_a_description() -> None:
    """A random.SystemRandom (no state) and a subclass of random.Random are not recorded, and say why where
    they can; a $rng of a kind this version does not make decodes to a description, a damaged one refuses, and
    a reader without the tag refuses it as unknown (as a 1.22 reader does a 1.23 recording's step)."""
    class Mine(random.Random):
        pass

    system = jsonval.encode(random.SystemRandom())["$opaque"]
    reason = jsonval.opaque_reason(jsonval.Opaque(system["type"], system["repr"]))
    assert reason is not None and "no state to record" in reason
    assert "$opaque" in jsonval.encode(Mine(1))
    unknown = jsonval.decode({"$rng": {"kind": "numpy.random.Later", "bytes": ""}})
    assert isinstance(unknown, jsonval.Opaque) and unknown.type == "numpy.random.Later"
    with pytest.raises(FormatError, match=r"\$rng payload"):
        jsonval.decode({"$rng": {"kind": "random.Random", "bytes": ""}})
    doc = jsonval.encode(np.random.default_rng(0))
    tags = jsonval._TAGS.pop("$rng")
    try:
        with pytest.raises(UnknownTagError, match="unknown tag '\\$rng'"):
            jsonval.decode(doc)
    finally:
        jsonval._TAGS["$rng"] = tags


@pytest.mark.parametrize(("kind", "bits_name", "words"), [
    ("numpy.random.Generator", "Later", "numpy.random.Generator on the bit generator Later"),
    ("numpy.random.Sampler", None, "numpy.random.Sampler")])
def test_a_generator_of_a_newer_versions_kind_is_refused_saying_to_upgrade(tmp_path: Path, kind: str,
                                                                          bits_name: str | None, words: str) -> None:
    """A $rng of a kind or bit generator this version does not make (a newer recorder's): the replay said it
    "could not be recorded as data", and it was recorded. It says which generator, and to upgrade, in one line."""
    path = tmp_path / "run.zarr"
    with recorder.record(path):
        jitter(torch.ones(2, 4), np.random.default_rng(1))

    def newer(_: int, doc: Any) -> Any:
        if not (isinstance(doc, dict) and isinstance(doc.get("args"), list) and len(doc["args"]) == 2):
            return None
        held = doc["args"][1]["$rng"]
        state = jsonval.loads(base64.b64decode(held["bytes"]))
        if bits_name is not None:
            state["bit_generator"] = bits_name
        held.update(kind=kind, bytes=base64.b64encode(jsonval.dumps(state)).decode("ascii"))
        return doc

    rewrite_docs(path, newer)
    res = pdbg_here("replay", str(path), "jitter (numpy Generator)", cwd=tmp_path)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert f"was called with a {words} passed as an argument" in lines[0], lines[0]
    assert "newer version" in lines[0] and "upgrade paperdebugger" in lines[0], lines[0]
    assert "could not be recorded as data" not in lines[0], lines[0]
    refusal = known_refusal(replayer.open(path).step(0))
    assert refusal is not None and words in refusal and "upgrade paperdebugger" in refusal, refusal
