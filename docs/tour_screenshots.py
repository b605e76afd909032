"""The README's tour pictures: the screens of `pdbg runs/nan_smooth_relu.zarr` (the recording
`make demo` makes), taken headless with Textual's Pilot as the tour goes: `g` (the NaN origin),
enter (the tensor inspector), `a` (alerts), `r` (a replay).

    make demo && .venv/bin/python docs/tour_screenshots.py   # writes docs/images/tour-*.svg
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import replayer
from tui.app import PdbgApp

HERE = Path(__file__).resolve().parent
SIZE = (120, 34)


async def screens(path: Path) -> dict[str, str]:
    app = PdbgApp(replayer.open(path), path=str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd())
                  else str(path))
    out = {}
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        await pilot.press("g")
        await pilot.pause()
        out["origin"] = app.export_screenshot(title="pdbg runs/nan_smooth_relu.zarr: g, the NaN origin")
        await pilot.press("enter")
        await pilot.pause()
        out["inspector"] = app.export_screenshot(title="enter: the tensor inspector")
        await pilot.press("escape")
        await pilot.press("a")
        await pilot.pause()
        out["alerts"] = app.export_screenshot(title="a: alerts")
        await pilot.press("escape")
        await pilot.press("r")
        await app.workers.wait_for_complete()
        await pilot.pause()
        out["replay"] = app.export_screenshot(title="r: the step replayed alone")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, default=Path("runs/nan_smooth_relu.zarr"))
    parser.add_argument("--out", type=Path, default=HERE / "images")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, svg in asyncio.run(screens(args.run.resolve())).items():
        (args.out / f"tour-{name}.svg").write_text(svg)
        print(args.out / f"tour-{name}.svg")


if __name__ == "__main__":
    main()
