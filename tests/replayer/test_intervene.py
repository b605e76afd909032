"""Interventions: swap a function or module, edit a tensor, override settings or the seed, on a
recorded step and inside an enclosing one; recipes; nothing leaks out of the replay."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

import recorder
import replayer
from recorder import snapshot, stats
from recorder.errors import StepNotFoundError
from replayer import compare, recipes
from replayer.intervene import InterventionError
from tests.cli import pdbg_here
from tests.models import record_training
from tests.replayer import nanmodels

STABLE = "tests.replayer.nanmodels:stable_smooth_relu"


@pytest.fixture(scope="module")
def stack_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, nanmodels.Stack]:
    """Two Scaled blocks; in iteration 1 the first block's SmoothReLU overflows (exp of ~1000)."""
    path = tmp_path_factory.mktemp("stack") / "run.zarr"
    torch.manual_seed(0)
    model = nanmodels.Stack(4)
    nanmodels.record_scales(path, model, (1.0, 1000.0))
    return path, model


def nonfinite(stats: dict[str, float]) -> int:
    return int(stats["nan"] + stats["inf"])


def test_a_stable_function_or_a_clamped_input_makes_the_origin_finite(stack_run: tuple[Path, object],
                                                                       tmp_path: Path) -> None:
    rec = replayer.open(stack_run[0])
    origin = replayer.first_nonfinite(rec).step
    assert (origin.name, origin.iteration) == ("smooth_relu", 1)
    for kwargs in ({"swap": {"smooth_relu": STABLE}}, {"edit": {"args.0": "x.clamp(-50, 50)"}},
                   {"swap": {"Eq. 2": lambda original: nanmodels.stable_smooth_relu}},  # original -> new
                   {"edit": {"args.0": lambda x: x.clamp(-50, 50)}}):
        res = replayer.replay(rec, origin, **kwargs)
        (out,) = res.outputs
        assert nonfinite(out.recorded) > 0 and nonfinite(out.replayed) == 0 and not res.match, kwargs
        assert res.intervention is not None and res.warnings == []
    clamped = replayer.replay(rec, origin, edit={"args.0": "x.clamp(-50, 50)"})
    x = origin.tensor("args.0").clamp(-50, 50)
    expected = torch.log1p(torch.exp(x + 1.0)) / 1.0  # what smooth_relu computes on the clamped input
    assert torch.equal(clamped.values["output"], expected)

    for flag in (["--swap", f"smooth_relu={STABLE}"], ["--edit", "args.0=x.clamp(-50, 50)"]):
        res = pdbg_here("replay", str(stack_run[0]), str(origin.index), *flag, cwd=tmp_path)
        assert res.returncode == 1, res.stderr
        assert "recorded: min" in res.stdout and "replayed: min" in res.stdout  # side by side
        assert "non-finite output values: 5 recorded, 0 now" in res.stdout
        doc = json.loads(pdbg_here("replay", str(stack_run[0]), str(origin.index), *flag, "--json",
                                   cwd=tmp_path).stdout)
        assert doc["outputs"][0]["recorded"]["inf"] == 5 and doc["outputs"][0]["replayed"]["inf"] == 0
        assert doc["intervention"] is not None


def test_an_edit_on_an_inner_step_propagates_through_the_enclosing_model(stack_run: tuple[Path, object],
                                                                         tmp_path: Path) -> None:
    rec = replayer.open(stack_run[0])
    res = replayer.replay(rec, "Model@iter=1", edit={"smooth_relu#0/args.0": "x.clamp(-50, 50)"})
    changes = [(s.step.name, s.step.module_path, s.change) for s in res.inner]
    assert changes == [("Scaled", "first", "became finite"), ("smooth_relu", "first", "became finite"),
                       ("Scaled", "second", "became finite"), ("smooth_relu", "second", "became finite")]
    after = [s for s in res.inner if s.step.index > rec.step("smooth_relu@iter=1#0").index]
    assert after and all(nonfinite(s.diffs[0].recorded) and not nonfinite(s.diffs[0].replayed) for s in after)
    assert nonfinite(res.outputs[0].replayed) == 0 < nonfinite(res.outputs[0].recorded)
    cli = pdbg_here("replay", str(stack_run[0]), "Model@iter=1", "--edit", "smooth_relu#0/args.0=x.clamp(-50, 50)",
               cwd=tmp_path)
    assert "step 14 smooth_relu at second (forward): became finite (output: 5 -> 0 non-finite)" in cli.stdout
    # an inner module's parameter: scaling the first block's weights down keeps exp in range
    weights = replayer.replay(rec, "Model@iter=1", edit={"first/fc.weight": "x * 1e-3", "first/fc.bias": "x * 0"})
    assert [s.change for s in weights.inner] == ["became finite"] * 4 and weights.warnings == []
    with pytest.raises(InterventionError, match="no parameter or buffer 'fc.nope'; it has fc.bias, fc.weight"):
        replayer.replay(rec, "Model@iter=1", edit={"first/fc.nope": "x"})
    # a STEP part naming no step inside (a typo, a call that is not there) is refused before the replay
    with pytest.raises(InterventionError, match=r"edit smooth_relu#7/args.0: no step inside step \d+ is "
                                                r"'smooth_relu#7'; the steps inside it are first#0, second#1, "
                                                r"smooth_relu#0, smooth_relu#1$"):
        replayer.replay(rec, "Model@iter=1", edit={"smooth_relu#7/args.0": "x * 0"})


def test_an_inner_step_is_named_by_its_path_relative_to_the_replayed_module(tmp_path: Path) -> None:
    """`--edit softmax/args.0=...` on a replay of blocks.0 edits blocks.0.softmax, as `--swap softmax=...`
    names it; the full path and the step name work too; a misspelt one is one line, exit 2."""
    path = tmp_path / "run.zarr"
    nanmodels.record_masked(path, (1.0, 1.0, 1.0, 1e4))
    rec = replayer.open(path)
    for key in ("softmax", "blocks.0.softmax", "NaiveSoftmax#0"):
        res = replayer.replay(rec, "blocks.0@iter=3", edit={f"{key}/args.0": "x.clamp(-50, 50)"})
        assert [(s.step.module_path, s.change) for s in res.inner] == [("blocks.0.softmax", "became finite")], key
        assert not res.warnings, res.warnings
    bad = pdbg_here("replay", str(path), "blocks.0@iter=3", "--edit", "sofmax/args.0=x", cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "pdbg: error: edit sofmax/args.0: no step inside step 24 is 'sofmax'; the steps inside it are "
        "blocks.0.softmax#0"]


def test_two_keys_naming_one_inner_tensor_are_refused(tmp_path: Path) -> None:
    """A relative and a full module path (or a step name) naming the same inner tensor, with two changes, are
    refused before the replay: which of them the step got would depend on their order."""
    path = tmp_path / "run.zarr"
    nanmodels.record_masked(path, (1.0, 1.0, 1.0, 1e4))
    rec = replayer.open(path)
    for first, second in (("softmax", "blocks.0.softmax"), ("blocks.0.softmax", "NaiveSoftmax#0")):
        with pytest.raises(InterventionError, match=rf"^edit {second}/args.0: names the tensor edit {first}/args.0 "
                                                    r"names \(args.0 of step \d+, blocks.0.softmax#0\); give each "
                                                    r"tensor one change$"):
            replayer.replay(rec, "blocks.0@iter=3", edit={f"{first}/args.0": "x * 0", f"{second}/args.0": "x"})
    bad = pdbg_here("replay", str(path), "blocks.0@iter=3", "--edit", "softmax/args.0=x * 0", "--edit",
                    "blocks.0.softmax/args.0=x", cwd=tmp_path)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "names the tensor" in bad.stderr


def test_a_parameter_named_by_its_path_and_by_its_inner_step_is_refused(stack_run: tuple[Path, object]) -> None:
    """The replayed step's parameter by its path below it (``first.fc.weight``) and the same parameter as its
    inner step's (``first/fc.weight``), with two changes: refused before the replay, as two keys naming one
    inner tensor are (both were applied, in the dict's order)."""
    rec = replayer.open(stack_run[0])
    with pytest.raises(InterventionError, match=r"^edit first/fc.weight: names the tensor edit first.fc.weight names "
                                                r"\(fc.weight of step \d+, .*\); give each tensor one change$"):
        replayer.replay(rec, "Model@iter=1", edit={"first.fc.weight": "x * 0", "first/fc.weight": "x * 2"})
    alone = replayer.replay(rec, "Model@iter=1", edit={"first.fc.weight": "x * 1e-3"})
    inner = replayer.replay(rec, "Model@iter=1", edit={"first/fc.weight": "x * 1e-3"})
    assert torch.equal(alone.values["output"].view(torch.int32), inner.values["output"].view(torch.int32))


@recorder.paper_step("Eq. 5 (\u03b1=1.5)")
def entmax_like(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x * 1.5, -1)


def softmax_last(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, -1)


@recorder.paper_step("Algorithm 1")
class Gated(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return entmax_like(self.fc(x))


def test_an_edit_or_swap_key_holding_an_equals_sign_is_taken_whole(tmp_path: Path) -> None:
    """--edit and --swap parted KEY=VALUE at the first '=': a label holding one ("Eq. 5 (α=1.5)") could not
    be named ("edit Eq. 5 (α: '1.5)/args.0=x*0' is not a Python expression"). A swap parts at the last '='
    (an import reference holds none); an edit at the first '=' whose STEP/ names a step (an expression may
    hold '=' too), as the TUI's e and s prompts do."""
    from tui.cmd_replay import split_pair

    path = tmp_path / "run.zarr"
    torch.manual_seed(0)
    model = Gated()
    with recorder.record(path, model=model):
        model(torch.randn(2, 4))
    rec = replayer.open(path)
    label = "Eq. 5 (\u03b1=1.5)"
    assert split_pair(f"{label}/args.0=x.clamp(min=0)", "--edit", rec) == (f"{label}/args.0", "x.clamp(min=0)")
    assert split_pair(f"{label}=tests.replayer.test_intervene:softmax_last", "--swap") == \
        (label, "tests.replayer.test_intervene:softmax_last")
    assert split_pair("args.0=x.clamp(min=0)", "--edit", rec) == ("args.0", "x.clamp(min=0)")
    assert split_pair("Gated@iter=0/args.0=x == 0", "--edit", rec) == ("Gated@iter=0/args.0", "x == 0")
    edited = pdbg_here("replay", str(path), "Algorithm 1", "--edit", f"{label}/args.0=x*0", cwd=tmp_path)
    assert edited.returncode == 1 and f"{label} (entmax_like), forward, iteration 0, call 0" in edited.stdout, \
        edited.stdout + edited.stderr
    swapped = pdbg_here("replay", str(path), "Algorithm 1", "--swap",
                        f"{label}=tests.replayer.test_intervene:softmax_last", cwd=tmp_path)
    assert swapped.returncode == 1 and "first divergence: step 1: " + label in swapped.stdout, \
        swapped.stdout + swapped.stderr


def test_a_swapped_class_gets_the_parameters_whose_names_match(stack_run: tuple[Path, object]) -> None:
    rec = replayer.open(stack_run[0])
    model = replayer.replay(rec, "Model@iter=1", swap={"first": nanmodels.StableScaled})
    notes = " | ".join(model.warnings)
    assert "not in the original, left as the replacement made them: gain, proj.bias, proj.weight" in notes
    assert "the original's fc.bias, fc.weight have no place in the replacement" in notes
    assert nonfinite(model.inner[0].diffs[0].replayed) == 0  # the swapped block ran

    same_layout = replayer.replay(rec, "Scaled@iter=1#0", swap={".": nanmodels.StableFc})
    step = rec.step("Scaled@iter=1#0")
    w, b = step.tensor("fc.weight"), step.tensor("fc.bias")
    expected = nanmodels.stable_smooth_relu((step.tensor("args.0") @ w.T + b) * 1000.0)
    assert torch.equal(same_layout.values["output"], expected)  # the recorded fc parameters were used
    assert same_layout.warnings == []


def test_bad_interventions_get_one_line_and_exit_code_2(stack_run: tuple[Path, object], tmp_path: Path) -> None:
    run = str(stack_run[0])
    cases = [
        (["--edit", "args.0=x.clamp(-50,"], "is not a Python expression"),
        (["--edit", "args.0=x.nosuch()"], "edit args.0: AttributeError"),
        (["--edit", "args.0=open('/etc/passwd')"], "an edit may use only x, torch and math"),
        (["--swap", "smooth_relu=tests.replayer.nanmodels:no_such_thing"], "has no no_such_thing"),
        (["--swap", "smooth_relu=no_such_package.mod:f"], "cannot import 'no_such_package.mod', which the swap names"),
        (["--swap", "smooth_relu=nocolon"], "'nocolon' is not an import reference: write MODULE:NAME"),
        (["--edit", "weights=x"], "has no tensor 'weights'; it has args.0"),
        (["--edit", "noequals"], "--edit takes KEY=VALUE"),
        (["--set", "nosuch=1"], "unknown setting 'nosuch'"),
    ]
    for flags, message in cases:
        res = pdbg_here("replay", run, "smooth_relu@iter=1", *flags, cwd=tmp_path)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1 and message in lines[0], (flags, res.stderr)
        assert "Traceback" not in res.stderr
    rec = replayer.open(stack_run[0])
    with pytest.raises(InterventionError, match="edit kwargs.beta: step .* has no tensor"):
        replayer.replay(rec, "smooth_relu@iter=1", edit={"kwargs.beta": "x"})
    # a plain function for a module step is called as a factory of the replacement module: say so
    with pytest.raises(InterventionError, match="called as a factory with the original module, raised .*; a module "
                                                "step is swapped for an nn.Module class, or a function"):
        replayer.replay(rec, "Scaled@iter=1#0", swap={".": nanmodels.stable_smooth_relu})
    # the TUI's s without a key swaps the step itself: its error names that, not a key "."
    with pytest.raises(InterventionError, match=r"^swap of the step itself \('\.'\): 'StableScaled' is not an import "):
        replayer.replay(rec, "Scaled@iter=1#0", swap={".": "StableScaled"})


def test_nothing_leaks_out_of_the_replay(stack_run: tuple[Path, nanmodels.Stack], tmp_path: Path) -> None:
    """The live model, the caller's generators and settings are as they were after swaps, edits,
    setting overrides and a seed."""
    path, live = stack_run
    rec = replayer.open(path)
    state = {k: v.clone() for k, v in live.state_dict().items()}
    torch.manual_seed(5)
    np.random.seed(6)
    random.seed(7)
    before = (torch.get_rng_state().clone(), np.random.get_state()[1].copy(), random.getstate(), snapshot.settings())
    replayer.replay(rec, "Model@iter=1", swap={"first": nanmodels.StableScaled, "Eq. 2": STABLE},
                    edit={"smooth_relu#1/args.0": "x * 0"}, settings={"deterministic": True, "num_threads": 1},
                    seed=3)
    after = (torch.get_rng_state(), np.random.get_state()[1], random.getstate(), snapshot.settings())
    assert torch.equal(before[0], after[0]) and np.array_equal(before[1], after[1]) and before[2:] == after[2:]
    assert type(live.first) is nanmodels.Scaled and live.first.forward.__func__ is nanmodels.Scaled.forward
    assert all(torch.equal(v, live.state_dict()[k]) for k, v in state.items())
    assert nanmodels.smooth_relu.__wrapped__.__name__ == "smooth_relu"


def test_a_seed_replaces_the_recorded_generator_states(tmp_path: Path) -> None:
    """Dropout: the recorded states reproduce the mask; a seed gives another one, the same each time."""
    path = tmp_path / "run.zarr"
    record_training(path, 1)
    rec = replayer.open(path)
    assert replayer.replay(rec, "Attention#0").match
    a, b = (replayer.replay(rec, "Attention#0", seed=1234) for _ in range(2))
    assert not a.match and torch.equal(a.values["output"], b.values["output"])
    assert a.intervention["seed"] == 1234


def test_recipes_are_saved_listed_and_applied_only_by_name(stack_run: tuple[Path, object], tmp_path: Path) -> None:
    import shutil

    run = tmp_path / "run.zarr"
    shutil.copytree(stack_run[0], run)
    res = pdbg_here("replay", str(run), "smooth_relu@iter=1", "--edit", "args.0=x.clamp(-50, 50)", "--save-recipe",
               "clamp-input", cwd=tmp_path)
    assert res.returncode == 1 and "saved as recipe 'clamp-input'" in res.stdout
    rec = replayer.open(run)
    saved = recipes.get(rec, "clamp-input")
    assert saved["edit"] == {"args.0": "x.clamp(-50, 50)"} and saved["result"]["outputs"][0]["replayed"]["inf"] == 0
    info = pdbg_here("info", str(run), cwd=tmp_path)
    assert "clamp-input: step 12 (smooth_relu): edit args.0=x.clamp(-50, 50)" in info.stdout
    assert json.loads(pdbg_here("info", str(run), "--json", cwd=tmp_path).stdout)["recipes"][0]["name"] == "clamp-input"
    plain = pdbg_here("replay", str(run), "smooth_relu@iter=1", "--json", cwd=tmp_path)
    assert json.loads(plain.stdout)["intervention"] is None  # a saved recipe does nothing unless named
    again = json.loads(pdbg_here("replay", str(run), "--recipe", "clamp-input", "--json", cwd=tmp_path).stdout)
    assert again["step"]["index"] == 12 and again["outputs"][0]["replayed"]["inf"] == 0
    again = pdbg_here("replay", str(run), "smooth_relu@iter=1", "--edit", "args.0=x.clamp(-40, 40)", "--save-recipe",
                 "clamp-input", cwd=tmp_path)
    assert "saved as recipe 'clamp-input' in" in again.stdout and "(replacing the one saved " in again.stdout
    missing = pdbg_here("replay", str(run), "--recipe", "nope", cwd=tmp_path)
    assert missing.returncode == 2 and "no recipe 'nope'" in missing.stderr and "clamp-input" in missing.stderr
    with pytest.raises(recipes.RecipeError, match="must be an expression"):
        recipes.save(rec, "fn", rec.step(12), edit={"args.0": lambda x: x})


def test_a_read_only_recording_refuses_a_recipe_and_a_bundle_in_one_line(stack_run: tuple[Path, object],
                                                                         tmp_path: Path) -> None:
    """A colleague's recording in a directory this user cannot write: --save-recipe raised a
    PermissionError traceback after the replay (its result lost), and a bundle written there raised
    one from tempfile. Both are refused in one line (exit 2), before anything runs, and nothing changes."""
    import hashlib
    import shutil
    import stat

    from tests.cli import pdbg_as_a_user

    received = tmp_path / "received"
    received.mkdir()
    run = received / "run.zarr"
    shutil.copytree(stack_run[0], run)

    def digest() -> str:
        return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(received.rglob("*")) if p.is_file())).hexdigest()

    before = digest()
    paths = [received, *received.rglob("*")]
    for p in paths:
        p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    try:
        res = pdbg_as_a_user("replay", str(run), "smooth_relu@iter=1", "--edit", "args.0=x.clamp(-50, 50)",
                             "--save-recipe", "clamp", cwd=tmp_path)
        assert res.returncode == 2 and res.stderr == (
            f"pdbg: error: cannot save a recipe in {run}: its directory is not writable (another user's, or a "
            "read-only disk); copy the recording somewhere writable to save recipes in it\n"), res.stderr
        res = pdbg_as_a_user("bundle", str(run), "smooth_relu@iter=1", "-o", "here.pdbg", cwd=received)
        assert res.returncode == 2 and res.stderr == (
            f"pdbg: error: cannot write here.pdbg: Permission denied in {received.resolve()}; give a path in a "
            "writable directory (-o PATH)\n"), res.stderr
    finally:
        for p in paths:
            p.chmod(p.stat().st_mode | stat.S_IWUSR)
    assert digest() == before and not (received / "here.pdbg").exists()


def test_an_edit_expression_reaches_torch_math_and_x_only(stack_run: tuple[Path, object], tmp_path: Path) -> None:
    """An expression is refused, before anything runs, when it reaches past torch's operations, tensor
    methods and math: a module torch imported, a dunder, a file, an int too large to compute."""
    rec = replayer.open(stack_run[0])
    marker = tmp_path / "ran"
    escapes = {f"torch.os.system('touch {marker}') or x": "reaches torch.os",
               "torch.sys.modules['os'].getpid() and x": "reaches torch.sys",
               "x.__class__": "reaches the attribute __class__",
               "torch.__builtins__": "reaches the attribute __builtins__",
               f"torch.load('{marker}')": "reaches torch.load",
               "torch.nn.Linear(4, 4).weight": "reaches torch.nn.Linear",
               f"torch.from_file('{marker}', True, 4)": "reaches torch.from_file",
               "'{0.__class__}'.format(x)": "reaches str.format",
               f"x.numpy().tofile('{marker}')": "reaches ndarray.tofile",
               "x.grad_fn": "reaches Tensor.grad_fn",
               "x * 9 ** 9 ** 9": "reaches an integer of",
               "(lambda: x)()": "uses a Lambda expression",
               "[__import__ for __import__ in x]": "reaches the name __import__",
               f"x.double().flatten().numpy()[0].dump('{marker}') or x": "reaches float64.dump",  # (float64 is a float)
               "x + math.factorial(10 ** 8) % 2": "reaches math.factorial",
               "x * 0 + ([0] * 10 ** 9)[0]": "reaches a list of 1000000000 items",
               "[x for x.real in [x]][0]": "assigns to x.real",
               "torch.set_default_dtype(torch.float64)": "reaches torch.set_default_dtype"}
    for text, message in escapes.items():
        with pytest.raises(InterventionError, match=message):
            replayer.replay(rec, "smooth_relu@iter=1", edit={"args.0": text})
    assert not marker.exists()
    allowed = ["torch.stack([r.clamp(-50, 50) for r in x])", "torch.nn.functional.hardtanh(x, -50.0, 50.0)",
               "torch.nn.init.zeros_(x.clone()) + x.clamp(-50, 50).to(torch.get_default_dtype())",
               "x.clamp(-50, 50) + 0 * torch.randn(x.shape, generator=torch.Generator().manual_seed(0))",
               "x.clamp(-50, 50) if x.shape[0] > 0 else x", "torch.nan_to_num(x).clamp(max=math.pi * 10)"]
    for text in allowed:
        res = replayer.replay(rec, "smooth_relu@iter=1", edit={"args.0": text})
        assert nonfinite(res.outputs[0].replayed) == 0 < nonfinite(res.outputs[0].recorded), text
    # In a fresh process torch imports modules the first time a float literal or a factory needs them:
    # through the expression's frame, which has no builtins of its own.
    for text in ("x.clamp(-50.0, 50.0)", "torch.where(x > 50, torch.full_like(x, 50.), x)"):
        res = pdbg_here("replay", str(stack_run[0]), "smooth_relu@iter=1", "--edit", f"args.0={text}", cwd=tmp_path)
        assert res.returncode == 1 and "non-finite output values: 5 recorded, 0 now" in res.stdout, res.stderr


def test_a_settings_override_leaves_every_precision_setting_as_it_was(stack_run: tuple[Path, object]) -> None:
    """Setting the legacy tf32 flags back moves torch's newer precision API ('none' to 'ieee'):
    it is put back too, so that the next plain replay has nothing to warn about."""
    rec = replayer.open(stack_run[0])
    before = snapshot.settings()
    for settings in ({"tf32": True}, {"matmul_precision": "medium"}):
        replayer.replay(rec, "smooth_relu@iter=1", settings=settings)
        assert snapshot.settings() == before, settings
    assert replayer.replay(rec, "smooth_relu@iter=1").warnings == []


def test_more_bad_interventions_get_one_line_and_exit_code_2(stack_run: tuple[Path, object], tmp_path: Path) -> None:
    run = str(stack_run[0])
    cases = [
        ("smooth_relu@iter=1", ["--edit", "args.0=x.to('meta')"], "edit args.0: NotImplementedError"),
        ("smooth_relu@iter=1", ["--set", "default_dtype=bogus"], "give a torch dtype by name"),
        ("smooth_relu@iter=1", ["--set", "matmul_precision=bogus"], "give one of highest, high, medium"),
        ("smooth_relu@iter=1", ["--set", "threads=2.5"], "a thread count is a positive integer"),
        ("smooth_relu@iter=1", ["--seed", str(2 ** 70)], "give an integer from"),
        ("smooth_relu@iter=1", ["--edit", "args.0=x*0", "--edit", "args.0=x+1"], "--edit args.0 is given twice"),
        ("Model@iter=1", ["--edit", "smooth_relu#0/args.7=x"], "smooth_relu#0 has no input 'args.7'; its recorded "
                                                               "inputs are args.0"),
    ]
    for step, flags, message in cases:
        res = pdbg_here("replay", run, step, *flags, cwd=tmp_path)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1 and message in lines[0], (flags, res.stderr)
    rec = replayer.open(run)
    for kwargs in ({"edit": ["args.0"]}, {"settings": "deterministic"}, {"swap": ["first"]}):
        with pytest.raises(InterventionError, match="give a dict"):
            replayer.replay(rec, "smooth_relu@iter=1", **kwargs)


class _SecondOnly(torch.nn.Module):
    """A replacement for the Stack that has no ``first``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.second = nanmodels.Scaled(d)

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return self.second(x, scale)


def test_a_swap_of_the_step_and_one_inside_it_does_not_depend_on_their_order(stack_run: tuple[Path, object]) -> None:
    rec = replayer.open(stack_run[0])
    alone = replayer.replay(rec, "Model@iter=1", swap={"first": nanmodels.StableFc}).values["output"]
    assert not torch.equal(alone, replayer.replay(rec, "Model@iter=1").values["output"])
    for swap in ({".": nanmodels.Stack, "first": nanmodels.StableFc},
                 {"first": nanmodels.StableFc, ".": nanmodels.Stack}):  # the first was lost in the root's swap
        res = replayer.replay(rec, "Model@iter=1", swap=swap)
        assert torch.equal(res.values["output"], alone), swap
    res = replayer.replay(rec, "Model@iter=1", swap={"first": nanmodels.StableFc, ".": _SecondOnly})
    assert "swap first: _SecondOnly, the step's replacement, has no submodule or step first; nothing swapped " \
           "there" in res.warnings


def test_an_intervention_is_reported_as_what_it_did(stack_run: tuple[Path, object], tmp_path: Path) -> None:
    """One that changes nothing says so (not "MATCH", the answer to another question); one that makes
    the replay raise says what it raised, not a count of non-finite values of no tensor."""
    run = str(stack_run[0])
    same = pdbg_here("replay", run, "smooth_relu@iter=1", "--set", "deterministic=True", cwd=tmp_path)
    assert same.returncode == 0 and same.stdout.rstrip().endswith(
        "NO CHANGE: the intervention left every output bit for bit as recorded"), same.stdout + same.stderr
    raised = pdbg_here("replay", run, "Scaled@iter=1#0", "--edit", "args.0=x[:, :2]", cwd=tmp_path)
    assert raised.returncode == 1 and raised.stdout.rstrip().splitlines()[-1].startswith(
        "MISMATCH, as an intervention makes it: the replay raised RuntimeError"), raised.stdout


def test_an_edit_key_may_name_its_tensor_as_role_and_name(stack_run: tuple[Path, object]) -> None:
    """``param:fc.weight`` names the tensor ``step.tensor`` reads under it, in an edit too (it was refused,
    listing ``fc.weight``): the replay is the one ``fc.weight`` gives, bit for bit."""
    rec = replayer.open(stack_run[0])
    step = rec.step("Scaled@iter=0#0")
    by_name = replayer.replay(rec, step, edit={"fc.weight": "x * 0.5", "args.0": "x + 1"})
    by_role = replayer.replay(rec, step, edit={"param:fc.weight": "x * 0.5", "input:args.0": "x + 1"})
    assert not by_name.match and by_role.warnings == by_name.warnings == []
    assert torch.equal(by_role.values["output"].view(torch.int32), by_name.values["output"].view(torch.int32))


def test_an_edit_that_changes_a_tensors_shape_or_dtype_says_so(stack_run: tuple[Path, object],
                                                                tmp_path: Path) -> None:
    """An edit that hands the step a tensor of another shape (a slice) or dtype is applied as given, and
    the replay says what it changed, so that outputs of another shape read as the edit's doing; one that
    keeps both says nothing of it."""
    rec = replayer.open(stack_run[0])
    origin = replayer.first_nonfinite(rec).step
    shape = tuple(origin.tensor("args.0").shape)
    sliced = replayer.replay(rec, origin, edit={"args.0": "x[:1]"})
    assert f"args.0: the edit changed its shape {shape} to {(1, *shape[1:])}; the step ran with it as it is" \
        in sliced.warnings, sliced.warnings
    double = replayer.replay(rec, origin, edit={"args.0": "x.double().clamp(-50, 50)"})
    assert "args.0: the edit changed its dtype float32 to float64; the step ran with it as it is" in double.warnings
    assert replayer.replay(rec, origin, edit={"args.0": "x.clamp(-50, 50)"}).warnings == []
    res = pdbg_here("replay", str(stack_run[0]), str(origin.index), "--edit", "args.0=x[:1]", cwd=tmp_path)
    assert "the edit changed its shape" in res.stdout + res.stderr, res.stdout + res.stderr


def test_a_recipe_keeps_settings_under_the_recordings_names(tmp_path: Path) -> None:
    """`--set deterministic=true` was saved as "deterministic" and listed so by pdbg info, while the
    replay said "set deterministic_algorithms=True" (and docs/FORMAT.md showed the latter)."""
    import recorder

    run = tmp_path / "run.zarr"
    with recorder.record(run, mode="full"):
        nanmodels.smooth_relu(torch.randn(4))
    rec = replayer.open(run)
    saved = recipes.save(rec, "det", rec.step(0), settings={"deterministic": True, "threads": 1})
    assert saved["settings"] == {"deterministic_algorithms": True, "num_threads": 1}
    assert "set deterministic_algorithms=True" in recipes.describe({**saved, "settings": {"deterministic": True}})


def test_the_api_names_its_errors_and_checks_a_role() -> None:
    """replayer's docstrings named ReplayError and InterventionError, which it did not export; a
    misspelt role gave an empty list."""
    from recorder.errors import PdbgError, RecordingError

    assert issubclass(replayer.ReplayError, replayer.PdbgError) and replayer.PdbgError is PdbgError
    assert issubclass(replayer.InterventionError, PdbgError) and issubclass(replayer.StepNotFoundError, PdbgError)
    step = replayer.Step.__new__(replayer.Step)
    with pytest.raises(RecordingError, match="unknown role 'bogus': use one of input, output, param"):
        replayer.Step.tensors(step, "bogus")


def test_a_replacement_written_after_the_recording_is_not_called_code_the_step_ran(stack_run: tuple[Path, object],
                                                                                   tmp_path: Path) -> None:
    """A fix swapped in is written after the recording, as every fix is: the replay warned that the step's
    module "uses" the new class from a file "modified after the recording began ... its code may not be what
    ran (a likely cause of any difference)", as if the difference the fix made were an artefact."""
    (tmp_path / "clamped_fix.py").write_text(
        "import torch\nfrom torch import nn\n\n\nclass Clamped(nn.Module):\n"
        "    def __init__(self, d):\n        super().__init__()\n        self.fc = nn.Linear(d, d)\n\n"
        "    def forward(self, x, scale):\n        return torch.tanh(self.fc(x) * scale).clamp(-0.5, 0.5)\n")
    res = pdbg_here("replay", str(stack_run[0]), "Scaled@iter=1#0", "--swap", ".=clamped_fix:Clamped", "--json",
                    cwd=tmp_path)
    doc = json.loads(res.stdout)
    assert res.returncode == 1 and not doc["match"] and doc["intervention"] is not None, res.stdout + res.stderr
    assert not [w for w in doc["warnings"] if "modified after the recording began" in w], doc["warnings"]


@recorder.paper_step("Eq. 4", description="inverse-frequency class weights, in numpy")
def np_class_weights(counts: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        w = counts.sum() / (counts * len(counts))
        return w / w.sum()  # a zero count: inf / inf = nan


@recorder.paper_step("Eq. 2", description="a weighted loss, weights given in numpy")
def np_weighted(x: torch.Tensor, weights: np.ndarray, scale: np.float32, n: int) -> torch.Tensor:
    return (x * torch.from_numpy(weights.copy()).float()).sum() * float(scale) * n


def test_a_numpy_argument_can_be_edited(tmp_path: Path) -> None:
    """"Would nan_to_num on the weights fix it?": an edit of a numpy argument was refused ("step 0 has no
    tensor 'args.0'; it has " and nothing). The expression gets it as a tensor and the call gets back
    a numpy value of its recorded dtype and layout; a step's non-tensor values are named where an edit
    or Step.tensor names something it does not have."""
    path = tmp_path / "run.zarr"
    with recorder.record(path, mode="full"):
        weights = np_class_weights(np.array([3, 0, 5, 2], dtype=np.float64))
        np_weighted(torch.ones(2, 4), np.ascontiguousarray(np.stack([weights, weights]).T).T, np.float32(0.5), 3)
    rec = replayer.open(path)
    res = replayer.replay(rec, "np_class_weights", edit={"args.0": "x.clamp(min=1)"})
    assert not res.match
    expected = np_class_weights.__wrapped__(np.array([3, 1, 5, 2], dtype=np.float64))
    assert not np.isnan(expected).any()
    seen = []
    spy = lambda fn: lambda *a: (seen.append(a), fn(*a))[1]  # noqa: E731
    res = replayer.replay(rec, "np_weighted", edit={"args.1": "torch.nan_to_num(x, nan=1.0)", "args.2": "x * 2"},
                          swap={"np_weighted": spy})
    (args,) = seen
    assert args[1].dtype == np.float64 and args[1].strides == (8, 16) and args[1].tobytes() == \
        np.nan_to_num(np.stack([weights, weights]), nan=1.0).tobytes()
    assert type(args[2]) is np.float32 and args[2] == np.float32(1.0)
    assert res.values["output"].isfinite().all()
    with pytest.raises(InterventionError, match=r"^edit args.3: args.3 of step 1 is an int; an edit changes a tensor "
                                                r"or a numpy value$"):
        replayer.replay(rec, "np_weighted", edit={"args.3": "x + 1"})
    with pytest.raises(InterventionError, match=r"^edit args.7: step 0 has no tensor 'args.7'; it has no tensors "
                                                r"\(and args.0, a numpy float64 array of shape \[4\]; output, a numpy "
                                                r"float64 array of shape \[4\], which are not tensors\)$"):
        replayer.replay(rec, "np_class_weights", edit={"args.7": "x"})
    with pytest.raises(StepNotFoundError, match=r"^step 0 has no tensor 'output'; it has no tensors \(and args.0, "):
        rec.step("np_class_weights").tensor("output")


@recorder.paper_step("Eq. 9", description="inverse-square-root learning rate")
def inv_sqrt_lr(step: int, base_lr: float) -> float:
    with np.errstate(divide="ignore"):
        return float(base_lr / np.sqrt(np.float64(step)))  # step 0: inf


def safe_lr(step: int, base_lr: float) -> float:
    return float(base_lr / np.sqrt(max(step, 1)))


@recorder.paper_step("Eq. 10", description="a scaled tensor and its mean over no elements")
def scaled_and_rate(x: torch.Tensor) -> tuple[torch.Tensor, float]:
    with np.errstate(divide="ignore"):
        return x * 2, float(np.float64(x.sum().item()) / np.float64(0))  # inf


def test_a_float_a_step_returned_is_counted_among_the_non_finite_outputs(tmp_path: Path) -> None:
    """A learning-rate schedule returned inf; a swap that makes it finite was reported as "non-finite output
    values: 0 recorded, 0 now", the values shown as "-": the non-tensor output's row carried no statistics.
    It counts the NaN/Inf of the numbers the step returned that are no tensors, recorded and replayed, and
    shows a single number as its min and max; beside a tensor, such a number is counted where it did not change."""
    path = tmp_path / "run.zarr"
    with recorder.record(path, mode="full"):
        inv_sqrt_lr(0, 1e-3)
        scaled_and_rate(torch.ones(3))
    rec = replayer.open(path)
    res = replayer.replay(rec, 0, swap={"inv_sqrt_lr": f"{__name__}:safe_lr"})
    (out,) = res.outputs
    assert out.name == "output structure" and not out.match and not res.match
    assert out.recorded == {"nan": 0, "inf": 1} and out.replayed == {"nan": 0, "inf": 0, "min": 1e-3, "max": 1e-3}
    assert out.reason.endswith("(NaN/Inf among their numbers: 1 recorded, 0 now)"), out.reason
    same = replayer.replay(rec, 0)
    assert same.match and [(d.name, d.recorded, d.replayed) for d in same.outputs] == [
        ("output structure", {"nan": 0, "inf": 1}, {"nan": 0, "inf": 1})]
    edited = replayer.replay(rec, 1, edit={"args.0": "x * 3"})
    assert not edited.match and [(d.name, d.match, d.recorded.get("inf"), d.replayed.get("inf")) for d in
                                 edited.outputs] == [("output.0", False, 0, 0), ("output structure", True, 1, 1)]

    swap = f"inv_sqrt_lr={__name__}:safe_lr"
    cli = pdbg_here("replay", str(path), "0", "--swap", swap, cwd=tmp_path)
    assert cli.returncode == 1 and "non-finite output values: 1 recorded, 0 now" in cli.stdout, cli.stdout
    assert "non-finite output values: 1 recorded, 1 now" in pdbg_here(
        "replay", str(path), "1", "--edit", "args.0=x * 3", cwd=tmp_path).stdout
    doc = json.loads(pdbg_here("replay", str(path), "0", "--swap", swap, "--json", cwd=tmp_path).stdout)
    assert doc["outputs"][0]["recorded"]["inf"] == 1 and doc["outputs"][0]["replayed"]["max"] == 1e-3


def test_an_edited_parameter_of_a_distribution_argument_makes_it_again(tmp_path: Path) -> None:
    """A MultivariateNormal given to a step is rebuilt from its recorded fields, among them the Cholesky
    factor its constructor derived from its covariance (``_unbroadcasted_scale_tril``), which log_prob
    reads: an edit of the covariance alone changed nothing, NO CHANGE, as if the prior's covariance did
    not matter. A distribution given an edited parameter is made again by its constructor from it; an
    edit of a field it derives says so; a parameter the constructor refuses is refused, in one line."""
    D = torch.distributions
    torch.manual_seed(0)
    a = torch.randn(4, 4)
    cov = a @ a.T + torch.eye(4)
    z = torch.randn(16, 4)
    path = tmp_path / "run.zarr"
    with recorder.record(path, mode="full"):
        nanmodels.prior_nll(z, D.MultivariateNormal(torch.zeros(4), covariance_matrix=cov))
        nanmodels.prior_nll(z, D.Independent(D.Normal(torch.zeros(4), torch.ones(4)), 1))
    rec = replayer.open(path)
    res = replayer.replay(rec, 0, edit={"args.1.covariance_matrix": "x * 4"})
    expected = -D.MultivariateNormal(torch.zeros(4), covariance_matrix=cov * 4).log_prob(z).mean()
    assert not res.match and torch.equal(res.values["output"], expected), res.values["output"]
    assert not any("no parameter" in w for w in res.warnings), res.warnings
    cli = pdbg_here("replay", str(path), "0", "--edit", "args.1.covariance_matrix=x*4", cwd=tmp_path)
    assert cli.returncode == 1 and "NO CHANGE" not in cli.stdout, cli.stdout
    moved = replayer.replay(rec, 0, edit={"args.1.loc": "x + 1"})
    assert torch.equal(moved.values["output"],
                       -D.MultivariateNormal(torch.ones(4), covariance_matrix=cov).log_prob(z).mean())
    inner = replayer.replay(rec, 1, edit={"args.1.base_dist.scale": "x * 2"})  # inside an Independent
    assert torch.equal(inner.values["output"],
                       -D.Independent(D.Normal(torch.zeros(4), torch.full((4,), 2.0)), 1).log_prob(z).mean())
    derived = replayer.replay(rec, 0, edit={"args.1._unbroadcasted_scale_tril": "x * 2"})
    assert not derived.match and any(w.startswith(
        "edit args.1._unbroadcasted_scale_tril: _unbroadcasted_scale_tril is no parameter of args.1, a "
        "MultivariateNormal, which derives it from loc, covariance_matrix when made: edited alone") for w in
        derived.warnings), derived.warnings
    # (the constructor's own reason: its argument check's, or, where the recording's process did not validate
    # distributions' arguments, as after torch.compile (dynamo turns the default off), the Cholesky's)
    with pytest.raises(InterventionError, match=r"^edit args\.1\.covariance_matrix: args\.1, a MultivariateNormal, "
                                                r"made again from the edited covariance_matrix, refused it "
                                                r"\((ValueError: .*PositiveDefinite|_LinAlgError: .*not "
                                                r"positive-definite)"):
        replayer.replay(rec, 0, edit={"args.1.covariance_matrix": "-x"})


def test_an_empty_or_bad_recipe_name_is_refused_before_the_replay(stack_run: tuple[Path, object],
                                                                  tmp_path: Path) -> None:
    """--save-recipe '' replayed and saved nothing without a word, and --recipe '' asked for a STEP; a name
    that cannot be saved under is refused in one line before the replay, an empty one too."""
    import shutil

    run = tmp_path / "run.zarr"
    shutil.copytree(stack_run[0], run)
    for name in ("", "a b"):
        res = pdbg_here("replay", str(run), "smooth_relu@iter=1", "--edit", "args.0=x.clamp(-50, 50)",
                        "--save-recipe", name, cwd=tmp_path)
        assert (res.returncode, res.stdout) == (2, ""), res.stdout
        assert res.stderr == f"pdbg: error: recipe name {name!r}: use letters, digits, '.', '_' or '-' (at most 64)\n"
    assert recipes.recipes(replayer.open(run)) == {}
    res = pdbg_here("replay", str(run), "--recipe", "", cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.startswith("pdbg: error: no recipe '' in "), res.stderr


def test_a_recipe_without_an_intervention_is_refused_before_the_replay(stack_run: tuple[Path, object],
                                                                       tmp_path: Path) -> None:
    """--save-recipe with no --swap, --edit, --set or --seed saved a recipe that replays the step as
    recorded; it is refused in one line before the replay, from the API too, and nothing is saved."""
    import shutil

    run = tmp_path / "run.zarr"
    shutil.copytree(stack_run[0], run)
    res = pdbg_here("replay", str(run), "smooth_relu@iter=1", "--save-recipe", "nothing", cwd=tmp_path)
    assert (res.returncode, res.stdout) == (2, ""), res.stdout
    assert res.stderr == ("pdbg: error: recipe nothing: there is no intervention to save; give a swap, an edit, "
                          "a setting or a seed with it (--swap, --edit, --set, --seed)\n")
    rec = replayer.open(run)
    with pytest.raises(recipes.RecipeError, match="no intervention to save"):
        recipes.save(rec, "nothing", rec.step("smooth_relu@iter=1"), edit={}, settings={})
    assert recipes.recipes(replayer.open(run)) == {}
    seeded = pdbg_here("replay", str(run), "smooth_relu@iter=1", "--seed", "0", "--save-recipe", "s", cwd=tmp_path)
    assert seeded.returncode in (0, 1) and "saved as recipe 's'" in seeded.stdout, seeded.stdout + seeded.stderr


class NormedHead(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.bn = torch.nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(x))


def test_a_class_swapped_in_from_the_originals_skeleton_says_so(tmp_path: Path) -> None:
    """swap={"bn": nn.LayerNorm}: no constructor arguments of BatchNorm1d are recorded, so LayerNorm was built
    from the BatchNorm's skeleton without a word, and the replay raised "'LayerNorm' object has no attribute
    'normalized_shape'" with nothing to say why; a warning now says how it was built, and what to give instead."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(NormedHead())
    with recorder.record(tmp_path / "run.zarr", model=model, modules=["0"]):
        model(torch.randn(8, 4))
    rec = replayer.open(tmp_path / "run.zarr")
    res = replayer.replay(rec, "0", swap={"bn": torch.nn.LayerNorm})
    assert not res.match and "normalized_shape" in (res.exception or ""), res.exception
    assert ("swap bn: LayerNorm built from the original's skeleton (no constructor arguments of BatchNorm1d were "
            "recorded), so it has the original's recorded attributes, not its own constructor's; to build it "
            "yourself, give a factory (lambda original: LayerNorm(...))") in res.warnings, res.warnings
    built = replayer.replay(rec, "0", swap={"bn": lambda original: torch.nn.LayerNorm(4)})
    assert built.exception is None and not any("skeleton" in w for w in built.warnings), built.warnings


@recorder.paper_step("Eq. 8", description="weights from scores, then the scores again")
def reweigh(h: torch.Tensor) -> torch.Tensor:
    return torch.softmax(h, -1)


@recorder.paper_step("Algorithm 2")
class Reweighted(torch.nn.Module):
    """Reads the inner step's input again after the call (``a * h``), as a gated block does."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return reweigh(h) * h


def test_an_in_place_edit_changes_only_what_the_inner_step_gets(tmp_path: Path) -> None:
    """An edit written in place (``x.mul_(0)``) on an inner step's input zeroed the enclosing step's own
    tensor too, which it reads again after the call: the replay answered "what if h were zero" where the
    edit asks "what if reweigh saw zeros". It changes a copy: the bits of the out-of-place edit."""
    path = tmp_path / "run.zarr"
    torch.manual_seed(0)
    model = Reweighted()
    with recorder.record(path, model=model):
        model(torch.randn(3, 4))
    rec = replayer.open(path)
    step = rec.step("Algorithm 2")
    h = step.tensor("args.0") @ step.tensor("fc.weight").T + step.tensor("fc.bias")
    expected = torch.softmax(h * 0, -1) * h
    for change in ("x * 0", "x.mul_(0)", "x.zero_()", lambda x: x.mul_(0)):
        res = replayer.replay(rec, step, edit={"reweigh/args.0": change})
        assert torch.equal(res.values["output"].detach().view(torch.int32), expected.view(torch.int32)), change
        assert [(s.step.name, s.change) for s in res.inner] == [("reweigh", "changed")], change
    own = replayer.replay(rec, step, edit={"args.0": "x.mul_(2)"})
    assert torch.equal(own.values["output"].view(torch.int32),
                       replayer.replay(rec, step, edit={"args.0": "x * 2"}).values["output"].view(torch.int32))


def smooth_relu_in_a_tuple(x: torch.Tensor, beta: float = 1.0, gamma: float = 1.0) -> tuple[torch.Tensor]:
    """smooth_relu's values, in a tuple the recorded call did not return."""
    return (torch.log1p(torch.exp(x + beta)) / gamma,)


def test_an_output_the_recording_lacks_is_counted_among_the_non_finite_values(stack_run: tuple[Path, object],
                                                                              tmp_path: Path) -> None:
    """A replacement that returned the overflowing values in a tuple was said to leave "5 recorded, 0 now":
    its ``output.0`` had no statistics, so the replay seemed to have made the NaN go away. They are shown
    and counted."""
    rec = replayer.open(stack_run[0])
    origin = replayer.first_nonfinite(rec).step
    ref = "tests.replayer.test_intervene:smooth_relu_in_a_tuple"
    res = replayer.replay(rec, origin, swap={"smooth_relu": ref})
    extra = res.diffs["output.0"]
    assert extra.reason == "produced by the replay, not in the recording" and extra.replayed["inf"] == 5
    assert extra.replayed == compare.stats_dict(stats.host_stats(res.values["output.0"].detach()))
    cli = pdbg_here("replay", str(stack_run[0]), str(origin.index), "--swap", f"smooth_relu={ref}", cwd=tmp_path)
    assert cli.returncode == 1 and "non-finite output values: 5 recorded, 5 now" in cli.stdout, cli.stdout + cli.stderr
    doc = json.loads(pdbg_here("replay", str(stack_run[0]), str(origin.index), "--swap", f"smooth_relu={ref}",
                               "--json", cwd=tmp_path).stdout)
    assert [o["replayed"]["inf"] for o in doc["outputs"] if o["name"] == "output.0"] == [5]


def test_a_recipes_file_of_another_shape_is_one_line_and_exit_code_2(stack_run: tuple[Path, object],
                                                                     tmp_path: Path) -> None:
    """recipes.json edited by hand or damaged, valid JSON but not {name: recipe}: pdbg info and
    replay --recipe printed a traceback (exit 1), and an array read as no recipes at all."""
    import shutil

    run = tmp_path / "run.zarr"
    shutil.copytree(stack_run[0], run)
    saved = pdbg_here("replay", str(run), "smooth_relu@iter=1", "--edit", "args.0=x.clamp(-50, 50)", "--save-recipe",
                      "clamp", cwd=tmp_path)
    assert saved.returncode == 1, saved.stderr
    good = json.loads((run / recipes.KEY).read_text())
    recipe = good["clamp"]
    for doc, says in (([recipe], "holds an array, not an object of recipes by name"),
                      ({"clamp": 5}, "holds a number as recipe 'clamp', not a recipe object"),
                      ({"clamp": {**recipe, "settings": "x"}}, "whose settings is not an object"),
                      ({"clamp": {**recipe, "edit": ["x * 0"]}}, "whose edit is not an object of keys and expressions"),
                      ({"clamp": {**recipe, "swap": {".": 5}}}, "whose swap is not an object of keys and import"),
                      ({"clamp": {k: v for k, v in recipe.items() if k != "step"}}, "without a step object"),
                      ({"clamp": {**recipe, "step": {**recipe["step"], "index": "12"}}}, "without a step object"),
                      ({"clamp": {**recipe, "seed": "0"}}, "whose seed is not an integer or null")):
        (run / recipes.KEY).write_text(json.dumps(doc))
        for argv in (("info", str(run)), ("replay", str(run), "--recipe", "clamp")):
            res = pdbg_here(*argv, cwd=tmp_path)
            assert res.returncode == 2 and res.stderr.count("\n") == 1 and says in res.stderr, (argv, res.stderr)
            assert res.stderr.startswith(f"pdbg: error: {run}: recipes.json "), res.stderr
        with pytest.raises(recipes.RecipeError, match="remove it or fix it$"):
            recipes.recipes(replayer.open(run))


def test_a_factorys_module_with_its_own_weights_says_so(stack_run: tuple[Path, object]) -> None:
    """swap={"first": lambda original: StableFc(4)} ran with StableFc's fresh fc weights, where a class swapped
    in takes the original's, and nothing said so: the fix looked like it changed the numbers by itself."""
    rec = replayer.open(stack_run[0])
    note = ("swap first: the factory's module runs with its own fc.bias, fc.weight, not the original's recorded "
            "values (a class swapped in takes those); to use them, have the factory copy them "
            "(new.load_state_dict(original.state_dict(), strict=False))")

    def fresh(original: torch.nn.Module) -> torch.nn.Module:
        new = nanmodels.StableFc(4)
        with torch.no_grad():
            new.fc.weight.fill_(0.5), new.fc.bias.fill_(-0.5)  # (what its own initialisation makes, whatever seed)
        return new

    made = replayer.replay(rec, "Model@iter=1", swap={"first": fresh})
    assert note in made.warnings, made.warnings

    def copying(original: torch.nn.Module) -> torch.nn.Module:
        new = nanmodels.StableFc(4)
        new.load_state_dict(original.state_dict())
        return new

    copied = replayer.replay(rec, "Model@iter=1", swap={"first": copying})
    built = replayer.replay(rec, "Model@iter=1", swap={"first": nanmodels.StableFc})
    assert copied.warnings == built.warnings == [], (copied.warnings, built.warnings)
    assert torch.equal(copied.values["output"].view(torch.int32), built.values["output"].view(torch.int32))
    assert replayer.replay(rec, "Model@iter=1", swap={"first": lambda original: original}).warnings == []


@recorder.paper_step("Eq. 9", description="scale by two")
class Doubler(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


class DoublerInPlace(torch.nn.Module):
    """The same numbers, written into its input as well."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return x.mul_(2)


def test_a_replacement_that_writes_into_its_input_says_so(tmp_path: Path) -> None:
    """A module swapped in that changed its input in place, where the recorded call left it as given, was said
    nowhere: the output matched, and the caller's tensor changed unseen."""
    path = tmp_path / "run.zarr"
    model = torch.nn.Sequential(Doubler())
    with recorder.record(path, model=model):
        model(torch.randn(2, 3))
    rec = replayer.open(path)
    res = replayer.replay(rec, "Doubler", swap={".": DoublerInPlace})
    assert res.diffs["output"].match and res.warnings == [
        "the replayed call changed args.0 in place, which the recorded call left as it was given: the intervention "
        "also changes what the step's caller goes on with"], res.warnings
    assert replayer.replay(rec, "Doubler", swap={".": Doubler}).warnings == []
    assert replayer.replay(rec, "Doubler", edit={"args.0": "x.mul_(1)"}).warnings == []  # (the edit's own copy)
