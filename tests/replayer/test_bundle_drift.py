"""Bundles made after the code of a step changed since recording: what the bundle carries, and what it says."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import recorder
import replayer

STEPS = '''
import torch
import recorder


@recorder.paper_step("Eq. 1")
def scale(x):
    return x * 2.0


@recorder.paper_step("Eq. 2")
def shift(x):
    return x + 1.0


@recorder.paper_step("Eq. 4")
def both(x):
    return shift(scale(x))
'''


@pytest.fixture
def edited_later(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[replayer.Recording, Path]:
    """A recording of two steps of ``driftsteps.py``; returns it and the file, which a test then edits."""
    module = tmp_path / "driftsteps.py"
    module.write_text(STEPS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "driftsteps", raising=False)
    steps = importlib.import_module("driftsteps")
    with recorder.record(tmp_path / "run.zarr"):
        steps.shift(steps.scale(torch.arange(4.0)))
    return replayer.open(tmp_path / "run.zarr"), module


def test_a_bundle_says_the_step_file_it_could_not_carry_because_the_code_changed(
        edited_later: tuple[replayer.Recording, Path], tmp_path: Path) -> None:
    """The file no longer holds the step as recorded: it was left out with nothing said but "the steps' code is
    in the recording", and the bundle then failed to import it elsewhere, even with --use-bundled-source."""
    rec, module = edited_later
    module.write_text(STEPS.replace("x * 2.0", "x * 3.0"))
    info = replayer.bundle(rec, "Eq. 1", tmp_path / "failure.pdbg")
    assert info.sources == []
    assert info.code_notes == [
        f"{module} is not carried: the code of scale there changed since recording, so the bundle holds no file "
        "with it as recorded (a replay of the bundle, with --use-bundled-source too, imports the code of the "
        "machine it runs on); restore the file as it was recorded and bundle again to carry it"]


def test_a_bundle_says_its_carried_file_holds_a_step_changed_since_recording(
        edited_later: tuple[replayer.Recording, Path], tmp_path: Path) -> None:
    """A line added at the end of a step's body still holds the recorded source as text, so the file was
    carried, changed, without a word: a replay with --use-bundled-source would run the new code."""
    rec, module = edited_later
    module.write_text(STEPS.replace("return x + 1.0", "return x + 1.0 + 0.5"))
    info = replayer.bundle(rec, "Eq. 2", tmp_path / "failure.pdbg")
    assert info.sources == [str(module)]
    assert info.code_notes == [f"the carried {module} holds shift changed since recording: a replay with "
                               "--use-bundled-source runs that code"]
    unchanged = replayer.bundle(rec, "Eq. 1", tmp_path / "other.pdbg")
    assert unchanged.sources == [str(module)] and unchanged.code_notes == []


HELPED = '''
import recorder
from drifthelp import act


@recorder.paper_step("Eq. 3")
def activate(x):
    return act(x) * 2.0
'''


def _bundle_of_a_helped_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Any]:
    """A step (HELPED's ``activate``) calling ``act`` of a helper module, both in files of ``tmp_path``, recorded
    and bundled into ``failure.pdbg``: the helper's path and what ``replayer.bundle`` returned."""
    helper = tmp_path / "drifthelp.py"
    helper.write_text("import torch\n\n\ndef act(x):\n    return torch.relu(x) * 2.0\n")
    (tmp_path / "drifthelped.py").write_text(HELPED)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("drifthelp", "drifthelped"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    steps = importlib.import_module("drifthelped")
    with recorder.record(tmp_path / "run.zarr"):
        steps.activate(torch.linspace(-1.0, 1.0, 8))
    return helper, replayer.bundle(replayer.open(tmp_path / "run.zarr"), "Eq. 3", tmp_path / "failure.pdbg")


def test_a_bundle_replayed_with_the_code_here_names_the_helper_file_that_is_not_its_copy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A helper the step calls, edited here and its time set back (a copy to another machine keeps no time
    to go by): the replay said that code "is not checked", though the bundle carries the file it came from."""
    import os

    helper, made = _bundle_of_a_helped_step(tmp_path, monkeypatch)
    assert str(helper) in made.sources
    then = helper.stat().st_mtime - 3600
    helper.write_text("import torch\n\n\ndef act(x):\n    return torch.relu(x) * 2.5\n")
    os.utime(helper, (then, then))
    for name in ("drifthelp", "drifthelped"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    res = replayer.replay(replayer.open(tmp_path / "failure.pdbg"), 0)
    assert res.match is False
    assert f"{helper} is not the copy this bundle carries, and the step's call ran act from it: a likely cause of " \
           "the difference (--use-bundled-source runs the bundle's copy)" in res.warnings, res.warnings
    assert not any("holds no hash" in w for w in res.warnings), res.warnings
    bundled = replayer.replay(replayer.open(tmp_path / "failure.pdbg"), 0, use_bundled_source=True)
    assert bundled.match is True
    want = replayer.open(tmp_path / "failure.pdbg").step(0).tensor("output")
    assert torch.equal(bundled.values["output"].view(torch.int32), want.view(torch.int32))


def test_info_of_a_bundle_names_a_carried_helper_file_that_changed_here(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A helper the step calls, edited here after bundling, the step's own code unchanged: `pdbg info` said the
    code was "unchanged" and nothing more, and the replay then mismatched; it names the carried file that is not
    the bundled copy (read, never run). The file as bundled is named by no such line."""
    from tests.cli import pdbg_here

    helper, _ = _bundle_of_a_helped_step(tmp_path, monkeypatch)
    same = pdbg_here("info", str(tmp_path / "failure.pdbg"), cwd=tmp_path)
    assert same.returncode == 0 and "source changed" not in same.stdout, same.stdout
    helper.write_text("import torch\n\n\ndef act(x):\n    return torch.relu(x) * 2.5\n")
    res = pdbg_here("info", str(tmp_path / "failure.pdbg"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert f"source changed: {helper} (module drifthelp) differs from the copy this bundle carries: what the " \
           "steps call in it may compute differently here (--use-bundled-source runs the bundle's copy)" \
           in res.stdout.splitlines(), res.stdout
    doc = pdbg_here("info", str(tmp_path / "failure.pdbg"), "--json", cwd=tmp_path)
    import json

    assert json.loads(doc.stdout)["bundle"]["sources_differ"] == [
        {"file": str(helper), "module": "drifthelp", "here": str(helper)}]


def test_a_replay_with_the_bundled_source_says_it_ran_that_copy(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """`pdbg replay BUNDLE --use-bundled-source` printed MATCH with nothing saying that the code which ran was the
    bundle's copy, not the (here edited) code of this machine; it names the copy's files, in --json too, and a
    replay with the code here says nothing of the kind."""
    import json

    from tests.cli import pdbg_here

    helper, made = _bundle_of_a_helped_step(tmp_path, monkeypatch)
    helper.write_text("import torch\n\n\ndef act(x):\n    return torch.relu(x) * 2.5\n")
    for name in ("drifthelp", "drifthelped"):  # (this process imported them as recorded)
        monkeypatch.delitem(sys.modules, name, raising=False)
    bundle = str(tmp_path / "failure.pdbg")
    res = pdbg_here("replay", bundle, "--use-bundled-source", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "code: the copy this bundle carries (--use-bundled-source), not the code here: " \
           + ", ".join(sorted(made.sources)) in res.stdout.splitlines(), res.stdout
    doc = json.loads(pdbg_here("replay", bundle, "--use-bundled-source", "--json", cwd=tmp_path).stdout)
    assert doc["match"] is True and doc["bundled_source"] == sorted(made.sources)
    here = pdbg_here("replay", bundle, cwd=tmp_path)
    assert here.returncode == 1 and "code: the copy" not in here.stdout
    assert json.loads(pdbg_here("replay", bundle, "--json", cwd=tmp_path).stdout)["bundled_source"] == []


def test_an_inner_step_of_a_bundle_says_the_bundle_kept_its_statistics(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Its refusal gave the recording's reasons ("recorded in stats mode, on an iteration --every skipped, or in
    flight mode"), none of them true: a bundle keeps an inner step's tensors as statistics by design (its results
    aside: an input that is neither the main step's nor another inner step's result)."""
    (tmp_path / "driftnested.py").write_text(STEPS.replace("return shift(scale(x))", "return shift(scale(x) * 3.0)"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "driftnested", raising=False)
    steps = importlib.import_module("driftnested")
    with recorder.record(tmp_path / "run.zarr"):
        steps.both(torch.arange(4.0))
    made = replayer.bundle(replayer.open(tmp_path / "run.zarr"), "Eq. 4", tmp_path / "outer.pdbg")
    bundled = replayer.open(made.path)
    with pytest.raises(Exception) as refused:
        replayer.replay(bundled, bundled.step(2))
    assert "a bundle keeps the tensors of its steps other than its main step 0 (both) as statistics only, " \
           "where that step does not share them: bundle this step itself from the recording to replay it" \
           in str(refused.value), str(refused.value)
    assert "stats mode" not in str(refused.value)
