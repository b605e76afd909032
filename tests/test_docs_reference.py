"""What README.md and docs/ show a reader matches what a recording holds and what pdbg says and offers."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

import recorder
import replayer
from tests.models import Tiny

ROOT = Path(__file__).resolve().parents[1]


def section(path: Path, start: str, end: str) -> str:
    text = path.read_text()
    return text[text.index(start):text.index(end, text.index(start))]


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("docs") / "run.zarr"
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with recorder.record(path, model=model, optimizer=opt):
        for _ in range(2):
            model(torch.tensor([[1, 2, 3]])).sum().backward()
            opt.step()
            opt.zero_grad()
    return path


def reliability_message(row_start: str) -> str:
    """The message docs/RELIABILITY.md's damage table quotes in the row that begins so."""
    for line in (ROOT / "docs" / "RELIABILITY.md").read_text().splitlines():
        if line.startswith(f"| {row_start}"):
            return line.split(" | ")[2].strip("`")
    raise AssertionError(f"docs/RELIABILITY.md has no row {row_start!r}")


@pytest.mark.parametrize("damage", ["no zarr.json", "no attributes"])
def test_reliability_quotes_what_a_directory_that_is_no_recording_gets(recording: Path, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       damage: str) -> None:
    """The damage table's message for a root zarr.json missing or without our attributes is the one raised."""
    copy = tmp_path / "run.zarr"
    shutil.copytree(recording, copy)
    root = copy / "zarr.json"
    if damage == "no zarr.json":
        root.unlink()
    else:
        doc = json.loads(root.read_text())
        del doc["attributes"]["paperdebugger"]
        root.write_text(json.dumps(doc))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(recorder.NotARecordingError) as err:
        replayer.open("run.zarr")
    assert str(err.value) == reliability_message("root `zarr.json` missing, or without PaperDebugger attributes")


def json_example(text: str, begins: str) -> str:
    """The ```json block of a document that begins so."""
    for block in re.findall(r"```json\n(.*?)```", text, re.S):
        if block.startswith(begins):
            return block
    raise AssertionError(f"no JSON example beginning {begins!r}")


def test_format_examples_hold_every_key_of_the_root_attributes_and_the_manifest(recording: Path) -> None:
    """docs/FORMAT.md's examples of the root zarr.json attributes and of manifest.json name every key a
    recording has (the checksum a reader checks among them)."""
    text = (ROOT / "docs" / "FORMAT.md").read_text()
    attributes = json.loads((recording / "zarr.json").read_text())["attributes"]["paperdebugger"]
    manifest = json.loads((recording / "manifest.json").read_text())
    for keys, example in ((attributes, json_example(text, '{"paperdebugger"')),
                          (manifest, json_example(text, '{"format": "paperdebugger.manifest"'))):
        missing = sorted(k for k in keys if f'"{k}"' not in example)
        assert not missing, f"docs/FORMAT.md's example {example.splitlines()[0]!r} lacks {missing}"


KEY_SPELLING = {"left_square_bracket": "`[`", "right_square_bracket": "`]`", "question_mark": "`?`",
                "slash": "`/`", "backslash": "`\\`", "colon": "`:`", "left": "`←`", "right": "`→`", "up": "`↑`",
                "down": "`↓`", "pageup": "PgUp", "pagedown": "PgDn", "home": "Home", "end": "End",
                "enter": "| enter", "escape": "escape"}


def test_readme_key_table_lists_the_keys_of_the_timeline_and_the_tensor_inspector() -> None:
    """Every key of the main screen and of the tensor inspector is in the README's table of keys."""
    from tui.app import Inspector, PdbgApp

    table = section(ROOT / "README.md", "| key | does |", "\n\n")
    missing = [f"{screen.__name__}: {key}" for screen in (PdbgApp, Inspector) for binding in screen.BINDINGS
               for key in binding.key.split(",") if KEY_SPELLING.get(key, f"`{key}`") not in table]
    assert not missing, f"the README's key table lacks {missing}"


def test_readme_names_every_mode_pdbg_record_takes_where_it_lists_them() -> None:
    """Where the README lists pdbg record's --mode choices, it lists all of them."""
    from tui.cli import build_parser

    parser = build_parser()
    record = next(a for a in parser._actions if a.dest == "command").choices["record"]
    modes = next(a for a in record._actions if "--mode" in a.option_strings).choices
    for listed in re.findall(r"--mode ?((?:[a-z]+[|\\]*)+)", (ROOT / "README.md").read_text()):
        named = [m for m in re.split(r"\\?\|", listed) if m]
        if len(named) > 1:
            assert sorted(named) == sorted(modes), f"the README lists --mode {listed}; pdbg record takes {modes}"


def test_the_readme_lists_every_document_of_docs() -> None:
    """README's Documentation list left out docs/RELIABILITY.md, which the README sends its reader to (remote
    stores, hard crashes, the errors the API raises): every docs/*.md is listed there, and each one exists."""
    listing = section(ROOT / "README.md", "## Documentation", "## Development")
    listed = set(re.findall(r"\]\((docs/[A-Z]+\.md)\)", listing))
    present = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    assert listed == present, (sorted(present - listed), sorted(listed - present))


def test_every_attribute_of_run_the_readme_names_is_one_a_recording_run_has(tmp_path: Path) -> None:
    """The README named `run.main_module`, which the object of `with recorder.record(...) as run` does not have
    (the module is in the recording's run_info): each `run.NAME` it names is an attribute of that object."""
    names = set(re.findall(r"`run\.([a-z_]+)\b(?!\.zarr)", (ROOT / "README.md").read_text())) - {"zarr"}
    assert names, "the README names no attribute of run"
    with recorder.record(tmp_path / "run.zarr") as run:
        missing = sorted(n for n in names if not hasattr(run, n))
    assert not missing, f"the README names run.{missing}, which a recording's run does not have"
