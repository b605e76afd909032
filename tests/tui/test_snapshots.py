"""Snapshots of the main screen, the tensor inspector, the alerts pane and a replay result, at a
fixed terminal size, from a recording kept with the tests (so that every value on screen is fixed).

Each screen is saved as SVG (to look at) and compared, as the text on it, with the text kept in
tests/tui/snapshots. After an intended change of a screen, look at the new SVGs and run
``PDBG_UPDATE_SNAPSHOTS=1 pytest tests/tui/test_snapshots.py``.
"""

from __future__ import annotations

import asyncio
import html
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import replayer
import replayer.state
from tui.app import PdbgApp

HERE = Path(__file__).parent
BUNDLE = HERE / "data" / "nan_iteration.pdbg"  # iteration 1 of tests/tui/recordings.py's nan_run
SNAPSHOTS = HERE / "snapshots"
UPDATE = os.environ.get("PDBG_UPDATE_SNAPSHOTS") == "1"
_TEXT = re.compile(r'<text class="[^"]*" x="([\d.]+)" y="[\d.]+" textLength="([\d.]+)" '
                   r'clip-path="url\(#[^)]*-line-(\d+)\)">([^<]*)</text>')


def screen_text(svg: str) -> str:
    """The characters on screen, line by line, from Textual's SVG."""
    lines: dict[int, list[tuple[int, str]]] = {}
    cell = None
    for x, length, line, content in _TEXT.findall(svg):
        text = html.unescape(content).replace("\xa0", " ")
        if cell is None and text:
            cell = float(length) / len(text)  # the width of one character cell
        lines.setdefault(int(line), []).append((round(float(x) / (cell or 1)), text))
    out = []
    for k in sorted(lines):
        row = ""
        for column, text in sorted(lines[k]):
            row = row.ljust(column) + text
        out.append(row.rstrip())
    return "\n".join(out) + "\n"


async def _screens(tmp: Path) -> dict[str, str]:
    rec = replayer.open(BUNDLE)
    app = PdbgApp(rec, path=BUNDLE.name, start=rec.main_step.index)
    out = {}
    async with app.run_test(size=(110, 32)) as pilot:
        await pilot.pause()
        out["main"] = app.export_screenshot()
        await pilot.press("enter")
        await pilot.pause()
        out["inspector"] = app.export_screenshot()
        await pilot.press("escape")
        await pilot.press("a")
        await pilot.pause()
        out["alerts"] = app.export_screenshot()
        await pilot.press("escape")
        await pilot.press("r")
        await app.workers.wait_for_complete()
        await pilot.pause()
        out["replay"] = app.export_screenshot()
    return out


@pytest.fixture(scope="module")
def screens(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    # The replay screen lists settings that differ from the recording's, and a process cannot change
    # its CPU capability, its thread counts' defaults (the cores it has), the environment it was
    # started in (OMP_NUM_THREADS=1 on a shared machine) or the Python it runs on (a patch release
    # other than the one that made the bundle): here they read as the recording's, so that
    # the screens are the same on every machine (the note itself: tests/replayer/test_replay.py).
    settings = replayer.open(BUNDLE).main_step.settings
    real = replayer.state.environment_differences

    def as_recorded(*args: Any, **kwargs: Any) -> list[str]:
        return [d for d in real(*args, **kwargs)
                if not d.startswith(("num_threads:", "num_interop_threads:", "environment variable ",
                                     "python version:"))]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.backends.cpu, "get_cpu_capability", lambda: settings.get("cpu_capability"))
        mp.setattr(replayer.state, "environment_differences", as_recorded)
        return asyncio.run(_screens(tmp_path_factory.mktemp("snap")))


@pytest.mark.parametrize("name", ["main", "inspector", "alerts", "replay"])
def test_screen(screens: dict[str, str], name: str, tmp_path: Path) -> None:
    svg = screens[name]
    text = screen_text(svg)
    expected_file = SNAPSHOTS / f"{name}.txt"
    if UPDATE:
        SNAPSHOTS.mkdir(exist_ok=True)
        (SNAPSHOTS / f"{name}.svg").write_text(svg)
        expected_file.write_text(text)
    (tmp_path / f"{name}.svg").write_text(svg)  # the picture, for a failing run
    assert expected_file.exists(), f"no snapshot for {name}: run with PDBG_UPDATE_SNAPSHOTS=1 and look at it"
    assert text == expected_file.read_text(), f"{name} changed; the new screen is in {tmp_path / (name + '.svg')}"
