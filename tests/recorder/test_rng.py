"""RNG snapshots: a restored snapshot reproduces random draws exactly, and restores the caller's."""

from __future__ import annotations

import base64
import json
import random

import numpy as np
import torch

import recorder
from recorder import snapshot
from recorder.store.reader import RunReader
from tests.recorder.readback import rng_parts


@recorder.paper_step("Eq. 9", description="dropout then noise")
def noisy_dropout(x: torch.Tensor) -> torch.Tensor:
    noise = float(np.random.rand()) + random.random()
    return torch.nn.functional.dropout(x, p=0.5, training=True) + noise


def test_restored_snapshot_reproduces_dropout_mask(run_path):
    """Applying a step's recorded RNG snapshot reproduces its dropout mask (and numpy/python draws)."""
    x = torch.randn(64, 64)
    with recorder.record(run_path, mode="full"):
        for _ in range(3):  # three calls, three different masks
            noisy_dropout(x)
    rank = RunReader(run_path).rank(0)
    outputs = []
    for step in range(3):
        recorded = rank.tensor(next(r for r in rank.tensor_records(step) if r.role == "output"))
        with snapshot.applied_rng(rng_parts(rank, step)):
            replayed = noisy_dropout(x)
        assert torch.equal(replayed.view(torch.int32), recorded.view(torch.int32))
        outputs.append(recorded)
    assert not torch.equal(outputs[0], outputs[1])


def test_applied_rng_restores_caller_state():
    """After applied_rng, the caller's torch, numpy and python generators continue where they were."""
    parts = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    torch.rand(5), np.random.rand(5), random.random()  # move every generator on
    expected_state = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    with snapshot.applied_rng(parts):
        torch.rand(100), np.random.rand(100), random.random()
    assert torch.equal(torch.get_rng_state(), expected_state[0])
    assert np.array_equal(np.random.get_state()[1], expected_state[1])
    assert random.getstate() == expected_state[2]


def test_rng_parts_round_trip_through_json():
    """Every generator state survives encode/decode exactly."""
    torch.rand(3), np.random.rand(3), random.random(), np.random.randn()  # has_gauss set
    parts = snapshot.rng_parts()
    for name, (_, state) in parts.items():
        back = snapshot.decode_rng_part(name, snapshot.encode_rng_part(name, state))
        if name == "torch":
            assert torch.equal(back, state)
        elif name == "numpy":
            assert back[0] == state[0] and np.array_equal(back[1], state[1]) and back[2:] == state[2:]
        else:
            assert back == state


def _same_numpy_state(got: tuple, expected: tuple) -> bool:
    """Equal legacy numpy states; the cached Gaussian only counts while has_gauss says it is held."""
    return (got[0] == expected[0] and np.array_equal(got[1], expected[1]) and got[2:4] == expected[2:4]
            and (not expected[3] or got[4] == expected[4]))


def test_rng_reader_sees_every_change_of_numpy_and_python_state():
    """A recording's RngReader reads numpy's and Python's generators only when their bytes changed;
    after every kind of change (draws, seeds, a cached Gaussian taken, a state put back whose words
    are the same but whose cached Gaussian is not) it returns exactly the public state."""
    reader = snapshot.RngReader()
    # On this interpreter and numpy the words are found: the reader's own path is what is tested.
    assert reader._py_at is not None and reader._np_at is not None
    saved = np.random.get_state(), random.getstate()
    try:
        np.random.seed(11), random.seed(11)
        np.random.standard_normal()  # a pair made: one value cached
        held_np = np.random.get_state()
        random.gauss(0.0, 1.0)  # Python caches the second value of its pair too
        held_py = random.getstate()
        ops = [
            lambda: None,
            np.random.standard_normal,  # takes the cached value: the words do not move
            lambda: np.random.set_state(held_np),  # the same words, the cached value back
            np.random.standard_normal,
            np.random.rand,
            lambda: np.random.rand(700),  # past the 624 words: regenerated
            lambda: np.random.seed(11),
            lambda: random.gauss(0.0, 1.0),  # takes Python's cached value: its words do not move
            lambda: random.setstate(held_py),
            random.random,
            lambda: [random.random() for _ in range(700)],
            lambda: random.seed(12),
            lambda: None,
        ]
        previous = None
        for i, op in enumerate(ops):
            op()
            parts = reader.parts()
            assert _same_numpy_state(parts["numpy"][1], np.random.get_state()), f"numpy state after op {i}"
            assert parts["python"][1] == random.getstate(), f"python state after op {i}"
            if previous is not None:  # a key is the same exactly when the state is
                for name, state_now in (("numpy", np.random.get_state()), ("python", random.getstate())):
                    same = (_same_numpy_state(previous[name][1], state_now) if name == "numpy"
                            else previous[name][1] == state_now)
                    assert (previous[name][0] == parts[name][0]) == same, f"{name} key after op {i}"
            previous = parts
    finally:
        np.random.set_state(saved[0])
        random.setstate(saved[1])


def test_rng_reader_reads_the_public_way_where_the_words_are_not_found(monkeypatch):
    """Where the generators' words cannot be confirmed (another interpreter or numpy), every step
    reads the public states, and they are still exact."""
    monkeypatch.setattr(snapshot, "_python_words_offset", lambda: None)
    monkeypatch.setattr(snapshot, "_numpy_gauss_offset", lambda: None)
    reader = snapshot.RngReader()
    np.random.standard_normal(), random.random()
    parts = reader.parts()
    assert _same_numpy_state(parts["numpy"][1], np.random.get_state())
    assert parts["python"][1] == random.getstate()


def _draw(obj, n: int) -> list:
    """n numbers from a generator object of any kind: a Gaussian (numpy caches half a pair) and a
    32-bit integer (a 64-bit bit generator keeps the other half) for numpy's."""
    if isinstance(obj, random.Random):
        return [obj.random() for _ in range(n)]
    if isinstance(obj, torch.Generator):
        return torch.randn(n, generator=obj).tolist()
    if isinstance(obj, np.random.BitGenerator):
        return obj.random_raw(n).tolist()
    ints = obj.randint(0, 2**31, n) if isinstance(obj, np.random.RandomState) else obj.integers(0, 2**31, n, np.uint32)
    return [*obj.standard_normal(n).tolist(), *ints.tolist()]


def test_generator_objects_round_trip_and_an_older_reader_reads_their_documents():
    """The state of each generator object a step can read or its module hold (torch, numpy's Generator
    over each bit generator, RandomState, a bit generator alone, random.Random) survives its JSON
    document exactly, as a part "global:<name>" and as a part "module:<place>" (1.17), and a generator
    of its kind is made again in it; each document holds its state in ``bytes``, which a 1.14 to 1.16
    reader decodes as it does any part it does not know (a torch state) and ignores, instead of calling
    the recording damaged."""
    objects = [torch.Generator().manual_seed(3), np.random.default_rng(4), np.random.Generator(np.random.MT19937(5)),
               np.random.Generator(np.random.Philox(6)), np.random.Generator(np.random.SFC64(7)),
               np.random.RandomState(8), np.random.PCG64DXSM(9), random.Random(10)]
    for obj in objects:
        for draws, part in ((0, "global:G"), (3, "global:G"), (2, "module:inner.gen")):
            _draw(obj, draws)
            key, state = snapshot.read_global_rng(obj)
            doc = json.loads(json.dumps({"rng": part, **snapshot.encode_rng_part(part, state)}))
            back = snapshot.decode_rng_part(part, doc)
            expected = _draw(obj, 5)
            made = snapshot.made_rng(back)
            assert type(made) is type(obj) and _draw(made, 5) == expected, type(obj)
            assert snapshot.set_global_rng(obj, back)
            assert snapshot.read_global_rng(obj)[0] == key
            assert _draw(obj, 5) == expected, type(obj)
            old = torch.frombuffer(bytearray(base64.b64decode(doc["bytes"])), dtype=torch.uint8)  # 1.14's fallback
            assert old.numel() > 0
    assert snapshot.read_global_rng(random.SystemRandom()) is None  # no state to record


def test_generator_objects_are_found_through_the_helpers_a_step_calls_and_nowhere_else():
    """The generator objects a step's code reads are found by name in its module's globals, through
    the module-level helpers it calls; a step that reads none has none (its calls read no state)."""
    space = {"torch": torch, "np": np, "RNG": np.random.default_rng(0), "SCALE": 2.0}
    exec("def plain(x):\n    return torch.relu(x) * SCALE + np.float32(1.0)\n"  # noqa: S102 - a module's code
         "def helper(x):\n    return x + RNG.random()\n"
         "def drawing(x):\n    return [helper(v) for v in x]\n", space)
    assert snapshot.find_global_rngs(space["plain"]) == ()
    found = snapshot.find_global_rngs(space["drawing"])  # through the comprehension's code and the helper's
    assert [(part, name) for part, _, name in found] == [("global:RNG", "RNG")]
    assert set(snapshot.global_rng_parts(found)) == {"global:RNG"}
    space["RNG"] = None  # a replay's script: main(), which made it, did not run
    assert snapshot.find_global_rngs(space["drawing"]) == ()
    places = snapshot.global_rng_places(space["drawing"], ["global:RNG", "global:GONE", "torch"])
    assert {part: (where is space, name) for part, (where, name) in places.items()} == \
        {"global:RNG": (True, "RNG"), "global:GONE": (True, "GONE")}


class _HoldsGenerators(torch.nn.Module):
    """A layer whose submodule holds a torch.Generator and which holds a numpy Generator itself."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)
        self.inner.gen = torch.Generator().manual_seed(0)
        self.rng = np.random.default_rng(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) + torch.rand(x.shape, generator=self.inner.gen) + float(self.rng.random())


def test_the_generators_a_module_holds_are_looked_for_once_per_module_object_and_read_at_each_call(
        run_path, monkeypatch):
    """The generators a step's module and its submodules hold are looked for once per module object (again
    only when one is replaced), and their states read at each call as parts of the step's RNG document;
    a module holding a torch.Generator no longer has its skeleton built, encoded and stored again at every
    call because the generator's state moved (what a call cost grew with the size of the module)."""
    from recorder import skeleton

    counts = {"found": 0, "built": 0}
    find, build = snapshot.find_module_rngs, skeleton.build

    def counted_find(module):
        counts["found"] += 1
        return find(module)

    def counted_build(module, memo=None, *rest):
        counts["built"] += memo is None  # (the skeleton of each submodule is built through it too)
        return build(module, memo, *rest)

    monkeypatch.setattr(snapshot, "find_module_rngs", counted_find)
    monkeypatch.setattr(skeleton, "build", counted_build)
    layer = recorder.annotate(_HoldsGenerators(), "Eq. 50")
    with torch.no_grad(), recorder.record(run_path, mode="stats"):
        for i in range(6):
            if i == 4:
                layer.rng = np.random.default_rng(9)  # replaced: looked for again
            layer(torch.ones(2, 4))
    assert counts == {"found": 2, "built": 2}
    rank = RunReader(run_path).rank(0)
    modules = [int(m) for m in rank.column("steps/module")]
    assert modules[:4] == [modules[0]] * 4 and modules[4:] == [modules[4]] * 2 and modules[0] != modules[4]
    parts = [rng_parts(rank, i) for i in range(6)]
    assert all({"module:inner.gen", "module:rng"} <= set(p) for p in parts)
    gens = [p["module:inner.gen"][2] for p in parts]
    assert all(not torch.equal(a, b) for a, b in zip(gens, gens[1:]))  # each call's state, read as it began
    assert torch.equal(gens[0], torch.Generator().manual_seed(0).get_state())
    assert parts[4]["module:rng"][2] == np.random.default_rng(9).bit_generator.state
