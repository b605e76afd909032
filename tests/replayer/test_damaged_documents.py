"""Documents of a recording from someone else hold values of another type, or nested past reason,
or settings no torch has: every command answers in one line (exit 2) or reads past them, never a
traceback, a hang or a dead process."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import recorder
import replayer
from recorder.errors import FormatError, ReplayError
from tests.cli import pdbg_here as pdbg
from tests.sealing import rewrite_docs
from tui import views


@recorder.paper_step("Eq. 1")
def scaled(x: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
    return x * scale


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("docs") / "run.zarr"
    with recorder.record(path) as run:
        for _ in range(2):
            scaled(torch.ones(3))
            run.next_iteration()
    return path


def forged(pristine: Path, tmp_path: Path, change: Any) -> Path:
    path = tmp_path / "run.zarr"
    shutil.copytree(pristine, path)
    rewrite_docs(path, change)
    return path


def is_definition(doc: Any) -> bool:
    return isinstance(doc, dict) and doc.get("kind") == "function"


def is_settings(doc: Any) -> bool:
    return isinstance(doc, dict) and "deterministic_algorithms" in doc


def test_a_definition_with_fields_of_another_type_is_read_past(pristine: Path, tmp_path: Path) -> None:
    """`"paper": null` was a TypeError traceback from pdbg info, find and bisect."""
    path = forged(pristine, tmp_path, lambda i, d: {**d, "paper": None, "line": "x", "ref": 5}
                  if is_definition(d) else None)
    step = replayer.open(path).step(0)
    assert step.paper == dict.fromkeys(("label", "algorithm", "step", "equation", "description"))
    assert "line" not in step.definition and "ref" not in step.definition
    for args in (["info", str(path)], ["find", str(path), "scaled"], ["bisect", str(path)]):
        res = pdbg(*args, cwd=tmp_path)
        assert res.returncode in (0, 1) and "Traceback" not in res.stderr, (args, res.stderr)
    from tests.tui.test_app import run

    async def body(app: Any, pilot: Any) -> None:  # the timeline's rows and the step pane draw it
        await pilot.press("down")
        await pilot.pause()
        assert app.timeline.step_index == 1

    run(body, path)


def test_names_and_generator_maps_of_another_type(pristine: Path, tmp_path: Path) -> None:
    path = forged(pristine, tmp_path, lambda i, d: ["not", "a", "name"] if d == "scaled" else
                  [1, 2] if isinstance(d, dict) and set(d) == {"numpy", "python", "torch"} else None)
    rec = replayer.open(path)
    assert rec.step(0).name == "['not', 'a', 'name']"
    assert replayer.first_divergence(rec, rec).first_difference is None  # (a list was unhashable)
    with pytest.raises(FormatError, match="the RNG states of step 0 are not a map of generators"):
        rec.step(0).rng


def test_arguments_nested_past_reason_are_refused_or_cut(pristine: Path, tmp_path: Path) -> None:
    """A 900-deep list in a step's arguments: replay was a RecursionError traceback, the TUI crashed
    on it (and froze on a 450-deep tuple)."""
    deep = "[" * 900 + "]" * 900
    path = forged(pristine, tmp_path, lambda i, d: ('{"args": [{"$tensor": "args.0"}], "kwargs": {"scale": '
                                                    + deep + "}}").encode()
                  if isinstance(d, dict) and "kwargs" in d else None)
    res = pdbg("replay", str(path), "0", cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        "pdbg: error: a document is nested too deeply to decode; the recording is damaged"]
    text = views.arguments_text(replayer.open(path).step(0).arguments)
    assert text.startswith("(<args.0>, scale=[[[[[[[[") and "…" in text
    tuples = {"$tuple": []}
    for _ in range(450):
        tuples = {"$tuple": [tuples]}
    assert "…" in views.arguments_text({"args": [tuples], "kwargs": [1]})  # kwargs of another type: left out


def test_settings_no_torch_has_are_refused_in_one_line(pristine: Path, tmp_path: Path) -> None:
    """An unknown default dtype or device was a traceback; a billion threads killed the process
    (libgomp out of memory)."""
    for key, value, message in (("default_dtype", "bogus", "the recorded setting default_dtype is 'bogus', which "
                                                           "is no torch default_dtype"),
                                ("default_device", "nope:0", "the recorded setting default_device is 'nope:0'")):
        path = forged(pristine, tmp_path / key, lambda i, d, k=key, v=value: {**d, k: v} if is_settings(d) else None)
        res = pdbg("replay", str(path), "0", cwd=tmp_path)
        assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr, res.stderr
        with pytest.raises(ReplayError, match=message):
            replayer.replay(replayer.open(path), 0)
    path = forged(pristine, tmp_path / "threads", lambda i, d: {**d, "num_threads": 10 ** 9, "env": "x"}
                  if is_settings(d) else None)
    threads = torch.get_num_threads()
    res = replayer.replay(replayer.open(path), 0)
    assert "setting num_threads=1000000000 is no thread count this replay can use; not applied" in res.warnings
    assert torch.get_num_threads() == threads and res.match


def test_a_repr_escapes_the_control_characters_a_recording_holds(pristine: Path, tmp_path: Path) -> None:
    """`rec.step(0)` at a Python prompt printed a name's escape sequences to the terminal."""
    path = forged(pristine, tmp_path, lambda i, d: "x\x1b]0;pwned\x07\x1b[2J" if d == "scaled" else None)
    rec = replayer.open(path)
    shown = repr(rec.step(0)) + repr(replayer.first_nonfinite(rec)) + repr(rec)
    assert "\x1b" not in shown and "\x07" not in shown and "x\\x1b]0;pwned\\x07" in repr(rec.step(0))


def test_the_tui_says_a_recording_is_damaged_and_stays_open(tmp_path: Path) -> None:
    """`g`, `a` and `b` on a recording whose record names are damaged: the FormatError ended the app."""
    from tests.tui.test_app import run

    path = tmp_path / "nan.zarr"
    with recorder.record(path) as rec_run:
        scaled(torch.zeros(3), float("inf"))  # 0 * inf: NaN from finite inputs
        rec_run.next_iteration()
    rewrite_docs(path, lambda i, d: 5 if d == "output" else None)
    with pytest.raises(FormatError, match="has a name that is not a string"):
        replayer.first_nonfinite(replayer.open(path))

    async def body(app: Any, pilot: Any) -> None:
        for key in ("g", "a", "b"):
            await pilot.press(key)
            await app.workers.wait_for_complete()
            await pilot.pause()
            assert "has a name that is not a string" in str(app.panel_text), key
            assert app.is_running

    run(body, path)
