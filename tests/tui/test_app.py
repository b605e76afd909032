"""The TUI, driven headless with the Pilot: every key and action, on small recordings."""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from textual.color import Color
from textual.widgets import Input, Static

import recorder
import replayer
from tests.models import record_ema, record_fine_tuning
from tests.replayer import nanmodels
from tests.tui.recordings import mixed_run, nan_run
from tui import views
from tui.app import ErrorApp, Inspector, PdbgApp, StepPane, Timeline, open_app

SIZE = (120, 36)


@pytest.fixture(scope="module")
def nan_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return nan_run(tmp_path_factory.mktemp("tui") / "nan.zarr")


@pytest.fixture(scope="module")
def mixed_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return mixed_run(tmp_path_factory.mktemp("tui") / "mixed.zarr")


def pane(app: PdbgApp) -> StepPane:
    return app.query_one(StepPane)


def panel(app: PdbgApp) -> str:
    return str(app.panel_text)


def run(coro_fn, path: Path, **kwargs) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        app = PdbgApp(replayer.open(path), **kwargs)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            await coro_fn(app, pilot)

    asyncio.run(main())


async def answer(pilot, text: str) -> None:  # type: ignore[no-untyped-def]
    """Type into the open prompt and submit."""
    await pilot.pause()
    prompt = pilot.app.screen.query_one(Input)
    prompt.value = text
    await pilot.press("enter")
    await pilot.pause()


def test_moving_through_steps_and_iterations(nan_path: Path) -> None:
    async def body(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        assert app.timeline.step_index == 0 and "Model" in pane(app).title.plain
        for key, expected in (("right", 1), ("l", 2), ("left", 1), ("h", 0), ("right_square_bracket", 10),
                              ("left_square_bracket", 0), ("end", 19), ("home", 0)):
            await pilot.press(key)
            await pilot.pause()
            assert app.timeline.step_index == expected, key
        await pilot.press("n")  # the first anomaly: the first non-finite step
        await pilot.pause()
        assert app.timeline.step_index == 10
        await pilot.press("n")
        await pilot.pause()
        assert app.timeline.step_index == 11
        await pilot.press("N")
        await pilot.pause()
        assert app.timeline.step_index == 10
        await pilot.press("pagedown")
        await pilot.pause()
        assert app.timeline.step_index == 19  # a page past the end stops at the last step
        assert pane(app).border_title == "step 19 · iteration 1"

    run(body, nan_path)


def test_g_goes_to_the_origin_and_the_step_pane_follows(nan_path: Path) -> None:
    async def body(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("g")
        await pilot.pause()
        origin = replayer.first_nonfinite(app.rec).step
        assert app.timeline.step_index == origin.index == 12
        lines = pane(app).plain().splitlines()  # what the step pane shows
        assert lines[0].startswith("Eq. 2 · smooth_relu · first · forward · iteration 1") and "nonfinite" in lines[0]
        assert "SmoothReLU" in lines[1]
        assert "produced output (5 Inf of 12) from finite inputs" in panel(app)
        step = pane(app)
        assert "torch.exp(x + beta)" in step.view.source and step.drift is None
        assert [t.name for t in step.view.tensors] == ["args.0", "output"] and step.view.tensors[1].nonfinite
        assert any(line.split()[:2] == ["output", "output"] and line.split()[-1] == "5" for line in lines)

    run(body, nan_path)


def test_the_step_pane_names_a_submodule_class_edited_after_recording(tmp_path: Path) -> None:
    """A Block whose own code is as recorded, but whose MLP (a class of the user's module file) was edited
    after recording: the step pane showed no change. It names MLP under the source's place, on the forward
    step and on its backward step; before the edit, and for the unchanged Gate, it says nothing."""
    from tests.models import edit_mlp, record_submodel

    path = record_submodel(tmp_path)

    async def unchanged(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        assert pane(app).drift is None and pane(app).code_drift == [] and "✎" not in pane(app).plain()

    run(unchanged, path)
    module = edit_mlp(tmp_path)

    async def body(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        step = pane(app)
        assert step.drift is None  # (Block's own code)
        assert step.code_drift == [f"✎ code of MLP (a submodule of Block: blocks.0.mlp) changed since recording "
                                   f"({module})"]
        assert "✎ code of MLP (a submodule of Block: blocks.0.mlp) changed since" in step.plain()
        await pilot.press("end")  # blocks.0's backward step: its forward's module
        await pilot.pause()
        assert app.step.phase == "backward" and app.step.module_path == "blocks.0"
        assert pane(app).code_drift == [f"✎ code of MLP (a submodule of Block: blocks.0.mlp) changed since "
                                        f"recording ({module})"]

    run(body, path)


def test_find_keeps_the_filter_and_takes_a_selector(nan_path: Path) -> None:
    """`/` and `\\` searched every step: one the filter hid cleared the filter; and they took only a
    condition, so "the previous call of this step where ..." could not be asked."""
    async def body(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("f")
        await answer(pilot, "smooth_relu")
        shown = set(app.model.rows.tolist())
        await pilot.press("home")
        await pilot.press("slash")
        await answer(pilot, "output.absmax > 0")
        assert app.model.filter_text == "smooth_relu" and app.timeline.step_index in shown
        assert app.step.name == "smooth_relu"
        await pilot.press("end")
        await pilot.press("backslash")
        await answer(pilot, "smooth_relu@iter=1 when output.absmax > 0")
        expected = replayer.find(app.rec, "smooth_relu@iter=1", "output.absmax > 0", start=int(app.model.rows[-1]),
                                 backward=True)
        assert expected is not None and expected.index in shown and app.timeline.step_index == expected.index
        await pilot.press("home")
        await pilot.press("slash")
        await answer(pilot, "smooth_relu@iter=1")  # a selector alone
        assert app.step.name == "smooth_relu" and app.step.iteration == 1
        for typo, said in (("smoth_relu when output.absmax > 0", "no step matches 'smoth_relu'; names in this"),
                           ("smoth_relu", "no step matches 'smoth_relu'; names in this")):
            await pilot.press("slash")
            await answer(pilot, typo)  # a selector that names no step: said, as pdbg find says it
            assert panel(app).startswith(said), panel(app)

    run(body, nan_path)


def test_goto_find_and_filter(nan_path: Path) -> None:
    async def body(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("colon")
        await answer(pilot, "smooth_relu@iter=1#1")
        assert app.timeline.step_index == 14
        await pilot.press("colon")
        await answer(pilot, "nothing@iter=9")
        assert "no step matches" in panel(app) and app.timeline.step_index == 14
        await pilot.press("home")
        await pilot.press("slash")
        await answer(pilot, "output.inf > 0")
        assert app.timeline.step_index == 10
        await pilot.press("end")
        await pilot.press("backslash")
        await answer(pilot, "output.absmax > 10")  # reverse-continue to a condition
        expected = replayer.find(app.rec, None, "output.absmax > 10", start=19, backward=True)
        assert app.timeline.step_index == expected.index
        await pilot.press("slash")
        await answer(pilot, "output.nope > 1")
        assert "must end in a statistic" in panel(app)
        await pilot.press("f")
        await answer(pilot, "phase:backward status:nonfinite")
        assert len(app.model.rows) == 5 and app.timeline.step_index == 15
        await pilot.press("f")
        await answer(pilot, "")
        assert len(app.model.rows) == 20
        await pilot.press("f")
        await answer(pilot, "[/]")  # what was typed is shown as typed, not read as markup (it crashed the app)
        assert panel(app) == "filter '[/]': 0 steps (f changes it)"

    run(body, nan_path)


def test_inspector_alerts_paper_and_help(nan_path: Path, mixed_path: Path) -> None:
    async def body(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("g")
        await pilot.press("enter")  # the first tensor of the step: its input
        await pilot.pause()
        assert isinstance(app.screen, Inspector)
        page = str(app.screen.query_one("#page", Static).render())
        assert "input args.0 · 3×4 float32 · step 12" in page and "histogram" in page
        assert "absmax across iterations 0…1 (this one underlined)" in page and "elements 0..11 of 12" in page
        await pilot.press("t")  # the next statistic
        await pilot.pause()
        assert "max across iterations" in str(app.screen.query_one("#page", Static).render())
        await pilot.press("o")
        await answer(pilot, "4")
        assert "elements 4..11 of 12" in str(app.screen.query_one("#page", Static).render())
        await pilot.press("escape")
        await pilot.press("p")
        await pilot.pause()
        tree = app.screen.query_one("#paper-tree")
        labels = [str(node.label) for node in tree.root.children]
        assert any(lb.startswith("Eq. 2") and "4/4" in lb for lb in labels), labels
        node = next(n for n in tree.root.children if str(n.label).startswith("Eq. 2"))
        tree.select_node(node)  # choosing a node filters the timeline to its steps
        await pilot.pause()
        assert len(app.model.rows) == 8 and {str(app.model.names[i]) for i in app.model.rows} == {"smooth_relu"}
        await pilot.press("question_mark")
        await pilot.pause()
        page = str(app.screen.query_one("#page", Static).render())
        for help_text in ("step forward", "go to the NaN origin (g)", "replay this step (r)", "diff"):
            assert help_text in page
        await pilot.press("escape")

    run(body, nan_path)

    async def alerts(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("a")
        await pilot.pause()
        page = " ".join(str(app.screen.query_one("#page", Static).render()).split())  # (as read: wrapped lines joined)
        assert "exception" in page and "ValueError: all negative" in page
        assert "watch gate: range expected [0.0, 1.0]" in page
        await pilot.press("escape")
        await pilot.press("n")
        await pilot.pause()
        assert app.step.status in ("alert", "exception")

    run(alerts, mixed_path)


def test_choosing_a_tensor_in_the_step_pane(nan_path: Path) -> None:
    async def body(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("g")
        await pilot.press("tab")  # the focus moves to the step pane: up/down choose a tensor there
        await pilot.pause()
        assert app.focused is pane(app)
        await pilot.press("down")
        await pilot.pause()
        assert app.timeline.step_index == 12 and pane(app).tensor().name == "output"
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, Inspector)
        assert "output output · 3×4 float32 · step 12" in str(app.screen.query_one("#page", Static).render())
        await pilot.press("escape")
        await pilot.press("up")
        await pilot.pause()
        assert pane(app).tensor().name == "args.0"
        # A click on a tensor's row opens it too: the row below the table's header.
        row = pane(app).plain().splitlines().index(next(
            line for line in pane(app).plain().splitlines() if line.startswith("output")))
        await pilot.click(StepPane, offset=(3, 1 + row))  # 1: the pane's top border
        await pilot.pause()
        assert isinstance(app.screen, Inspector) and pane(app).tensor().name == "output"
        await pilot.press("escape")
        await pilot.press("shift+tab")
        await pilot.press("right")  # the timeline has the focus again: the cursor moves
        await pilot.pause()
        assert app.timeline.step_index == 13

    run(body, nan_path)


def test_the_header_keeps_the_recordings_file_name_at_80_columns(nan_path: Path, tmp_path: Path) -> None:
    """At 80 columns the header cut a long path at its end, the file's name with it; the path now gives way
    from its start ("…/runs/gpt2_nan.zarr"), and a wider screen shows more of it again."""
    from textual.widgets._header import HeaderTitle

    path = tmp_path / "a_directory_with_a_long_name" / "experiments" / "runs" / "gpt2_nan.zarr"
    shutil.copytree(nan_path, path)

    async def main() -> None:
        app = PdbgApp(replayer.open(path), path=str(path))
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause()
            drawn = app.query_one(HeaderTitle).render_line(0).text.strip()
            assert drawn.endswith("complete · 20 steps · …/runs/gpt2_nan.zarr"), drawn
            await pilot.resize_terminal(160, 40)
            await pilot.pause()
            drawn = app.query_one(HeaderTitle).render_line(0).text.strip()
            assert drawn.endswith("/a_directory_with_a_long_name/experiments/runs/gpt2_nan.zarr"), drawn

    asyncio.run(main())


def test_page_and_edge_keys_in_the_step_pane_choose_a_tensor(nan_path: Path) -> None:
    """With the focus in the step pane, PgDn PgUp Home End move the chosen tensor, as ↑ ↓ do (they only
    scrolled: End took the view to the code and enter then opened the first tensor, out of view); End
    pressed again on the last tensor, or ↓ there, scrolls on to the code."""
    async def main() -> None:
        app = PdbgApp(replayer.open(nan_path))
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause()
            await pilot.press("tab")  # step 0: the model's six tensors
            step_pane = pane(app)
            last = len(step_pane.view.tensors) - 1
            page = max(1, step_pane.scrollable_content_region.height - 1)
            assert last == 5 and app.timeline.step_index == 0
            for key, chosen in (("end", last), ("home", 0), ("pagedown", min(last, page)), ("pageup", 0),
                                ("end", last)):
                await pilot.press(key)
                await pilot.pause()
                assert step_pane.selected == chosen, key
                y = step_pane._table_at + 1 + chosen
                assert step_pane.scroll_offset.y <= y < step_pane.scroll_offset.y + step_pane.size.height, key
            await pilot.press("end")  # again, on the last tensor: the code below the table
            await pilot.pause()
            assert step_pane.selected == last and step_pane.scroll_offset.y == step_pane.max_scroll_y > 0
            await pilot.press("home")
            await pilot.pause()
            assert step_pane.selected == 0 and step_pane.scroll_offset.y == 0
            for _ in range(last):
                await pilot.press("down")
            await pilot.press("down")  # past the last tensor: the view scrolls on
            await pilot.pause()
            assert step_pane.selected == last and step_pane.scroll_offset.y > 0
            await pilot.press("end", "enter")
            await pilot.pause()
            assert isinstance(app.screen, Inspector) and step_pane.tensor() is step_pane.view.tensors[last]
            assert app.timeline.step_index == 0  # the timeline's cursor stayed where it was

    asyncio.run(main())


def test_long_parameter_names_keep_their_end_in_the_step_pane(tmp_path: Path) -> None:
    """A submodule with a long name: its weight and bias were both cut to "input_projection_with_a_lon…",
    and which of them held the NaN could not be read. Their names keep their start and their end, at 80 and
    120 columns."""
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.input_projection_with_a_long_name = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.input_projection_with_a_long_name(x)

    path = tmp_path / "run.zarr"
    model = torch.nn.Sequential(Block())
    with recorder.record(path, model=model, modules=["*"]):
        model(torch.randn(2, 4))

    async def main(size: tuple[int, int]) -> list[str]:
        app = PdbgApp(replayer.open(path))
        async with app.run_test(size=size) as pilot:
            await pilot.pause()
            return [line.split()[1] for line in pane(app).plain().splitlines() if line.startswith("param")]

    for size in ((80, 24), (120, 40)):
        names = asyncio.run(main(size))
        assert len(names) == 2 and all(n.startswith("input_proj") and "…" in n for n in names), names
        assert names[0].endswith("long_name.weight") and names[1].endswith("long_name.bias"), names


def test_the_chosen_tensor_is_marked_on_every_row(nan_path: Path) -> None:
    """The chosen tensor's row has the highlight's background, on a striped row of the table too (the
    stripe hid it on every second row: enter opened a tensor that did not look chosen)."""
    async def body(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("g", "tab")
        step_pane = pane(app)
        for chosen in range(len(step_pane.view.tensors)):
            await pilot.pause()
            assert step_pane.selected == chosen
            y = step_pane._table_at + 1 + chosen - step_pane.scroll_offset.y
            drawn = [s for s in step_pane.render_line(y) if s.text.strip()]
            assert drawn and {s.style.bgcolor for s in drawn} == {Color.parse("#264f78").rich_color}, chosen
            await pilot.press("down")

    run(body, nan_path)


def test_bisect_names_the_softmax_of_a_key_padding_mask_as_first_nonfinite_does(tmp_path: Path) -> None:
    """`b` on a run whose nn.MultiheadAttention got a sequence that is all padding named the
    masked_fill_ writing the mask's -inf; it names the softmax that made the NaN, as
    replayer.first_nonfinite(ops=True) does, and the masked_fill_ as where its Inf came from."""
    path = tmp_path / "run.zarr"
    nanmodels.record_padded(path)
    origin = replayer.first_nonfinite(replayer.open(path), ops=True)
    assert origin.op is not None and origin.op.name == "aten::_softmax"

    async def body(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("b")
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert app.timeline.step_index == origin.step.index
        assert f"operation: {origin.op.where()}\n{origin.op_note}" in panel(app), panel(app)

    run(body, path)


def test_actions_replay_bisect_edit_swap(nan_path: Path) -> None:
    async def body(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("r")
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert "replay of step 0: bitwise match" in panel(app)
        await pilot.press("b")
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert app.timeline.step_index == 12 and "operation: aten::exp" in panel(app)
        await pilot.press("e")
        await answer(pilot, "args.0=x.clamp(-50, 50)")
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert "MISMATCH" in panel(app) and "inf 5 → replayed nan 0 inf 0" in panel(app)
        await pilot.press("s")
        await answer(pilot, "tests.replayer.nanmodels:stable_smooth_relu")
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert "inf 5 → replayed nan 0 inf 0" in panel(app)
        # escape cancels the running action: its result, when it comes, is not shown
        release = threading.Event()

        def slow_action() -> None:
            release.wait(30)
            app._report("late result")

        app.run_worker(slow_action, thread=True, group="action", exclusive=True)
        await pilot.pause()
        await pilot.press("escape")
        await pilot.pause()
        release.set()
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert panel(app) == "cancelled"
        await pilot.press("e")
        await answer(pilot, "args.0=x.(")
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert "is not a Python expression" in panel(app)

    run(body, nan_path)


def test_edit_and_swap_prompts_take_a_label_holding_an_equals_sign(tmp_path: Path) -> None:
    """The e and s prompts parted TENSOR=EXPR and KEY=REF at the first '=', so that a label holding one
    (Eq. 5 (α=1.5)) could not be named: they part as pdbg replay's --edit and --swap do."""
    from tests.replayer.test_intervene import Gated

    path = tmp_path / "run.zarr"
    torch.manual_seed(0)
    model = Gated()
    with recorder.record(path, model=model):
        model(torch.randn(2, 4))
    label = "Eq. 5 (\u03b1=1.5)"

    async def body(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        assert app.timeline.step_index == 0
        await pilot.press("e")
        await answer(pilot, f"{label}/args.0=x.clamp(min=0) * 0")
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert "MISMATCH" in panel(app) and "not a Python expression" not in panel(app), panel(app)
        await pilot.press("s")
        await answer(pilot, f"{label}=tests.replayer.test_intervene:softmax_last")
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert "MISMATCH" in panel(app) and "cannot import" not in panel(app), panel(app)

    run(body, path)


def test_actions_bundle_and_diff(nan_path: Path, tmp_path: Path) -> None:
    other = nan_run(tmp_path / "other.zarr", scales=(1.0, 999.0))

    async def body(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("g")
        await pilot.press("x")
        await answer(pilot, str(tmp_path / "origin.pdbg"))
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert (tmp_path / "origin.pdbg").exists() and "verified: replays bit for bit" in panel(app)
        await pilot.press("d")
        await answer(pilot, str(other))
        await app.workers.wait_for_complete()
        await pilot.pause()
        # the first block is the innermost step whose tensors came in equal and went out different
        assert app.timeline.step_index == 11 and "non-tensor argument scale differs (1000.0 vs 999.0)" in panel(app)
        # Runs parted by their data have no root cause: the cursor goes to where the results first
        # differ, and the panel is not coloured as a match.
        await pilot.press("d")
        await answer(pilot, str(other_data))
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert app.timeline.step_index == 0 and "but its inputs differ too" in panel(app)
        assert app.panel_text.style != "green"

    torch.manual_seed(0)
    model = nanmodels.Stack(4)
    torch.randn(1)  # other inputs, the same weights
    other_data = tmp_path / "other_data.zarr"
    nanmodels.record_scales(other_data, model, (1.0, 1000.0))
    run(body, nan_path)


def test_command_palette_lists_the_actions(nan_path: Path) -> None:
    async def body(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("ctrl+p")
        await pilot.pause()
        await pilot.press(*"replay this")
        await pilot.pause(0.5)
        await pilot.press("enter")
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert "bitwise match" in panel(app)

    run(body, nan_path)


def test_a_live_recording_refreshes_on_R(tmp_path: Path) -> None:
    path = tmp_path / "live.zarr"
    model = nanmodels.Scaled(4)
    run_ = recorder.record(path, model=model)
    try:
        model(torch_ones(), 1.0)
        assert run_.flush()

        async def body(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
            assert app.model.n == 2 and "recording" in app.sub_title
            model(torch_ones(), 2.0)
            assert run_.flush()
            await pilot.press("R")
            await pilot.pause()
            assert app.model.n == 4 and "4 steps committed" in panel(app)

        run(body, path)
    finally:
        run_.close()


def torch_ones():  # type: ignore[no-untyped-def]
    import torch

    return torch.ones(2, 4)


def test_bad_recordings_get_a_message_screen(nan_path: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken.zarr"
    shutil.copytree(nan_path, broken)
    (broken / "manifest.json").write_text("{")
    app = open_app(str(broken))
    assert isinstance(app, ErrorApp) and "truncated or corrupt" in app.message

    async def main() -> None:
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause()
            assert "cannot open" in str(app.query_one("#error", Static).render())
            await pilot.press("q")

    asyncio.run(main())
    crashed = tmp_path / "crashed.zarr"
    shutil.copytree(nan_path, crashed)
    manifest = (crashed / "manifest.json").read_text().replace('"status": "complete"', '"status": "recording"')
    (crashed / "manifest.json").write_text(manifest.replace('"pid": ', '"pid": 999999999, "x": '))

    async def crashed_body(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        assert "crashed" in app.sub_title and app.model.n == 20

    run(crashed_body, crashed)


def test_damaged_data_and_a_vanished_recording_keep_the_app_running(nan_path: Path, tmp_path: Path) -> None:
    """A tensor whose chunk is damaged: the inspector says so (the app died with a traceback); R after
    the recording was deleted: the panel says so and the view stays (the app died too)."""
    damaged = tmp_path / "damaged.zarr"
    shutil.copytree(nan_path, damaged)
    for chunk in (damaged / "rank0" / "blobs" / "u4" / "c").iterdir():
        chunk.write_bytes(chunk.read_bytes()[:20])

    async def body(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("g", "enter")
        await pilot.pause()
        assert isinstance(app.screen, Inspector)
        page = str(app.screen.query_one("#page", Static).render())
        assert page.startswith("cannot show input args.0: ") and "truncated or damaged" in page
        await pilot.press("escape")
        shutil.rmtree(damaged)
        await pilot.press("R")
        await pilot.pause()
        assert panel(app).startswith("cannot refresh: ") and app.model.n == 20 and app.step is not None

    run(body, damaged)


def test_a_jump_to_a_step_the_filter_hides_clears_the_filter(nan_path: Path) -> None:
    """With a filter that hides the origin, g lands on the origin (not on the nearest shown step),
    and a note says the filter was cleared; a filter that matches nothing says so (not "no steps
    committed yet"), and end then keeps the cursor in range."""
    async def body(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        app.apply_filter("phase:backward")
        await pilot.pause()
        await pilot.press("g")
        await pilot.pause()
        assert app.step is not None and app.step.status == "nonfinite" and app.step.phase == "forward"
        assert app.model.filter_text == "" and len(app.model.rows) == app.model.n
        assert "filter cleared: it hid step" in " ".join(str(n.message) for n in app._notifications)
        app.apply_filter("zzzz")
        await pilot.press("end")
        await pilot.pause()
        assert "no step matches the filter 'zzzz' (f changes it)" in pane(app).plain()
        assert app.timeline.cursor == 0
        app.apply_filter("")
        await pilot.pause()
        assert app.step is not None

    run(body, nan_path)


def test_a_paper_node_filters_to_exactly_its_steps(mixed_path: Path) -> None:
    """Choosing a node keeps the steps named under it: "step 5" (of Algorithm 1) was taken as the
    text filter "step" and "5", which kept none; a label that is part of a path (a "Block" node and
    "blocks.0") kept every step."""
    async def body(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("p")
        await pilot.pause()
        tree = app.screen.query_one("#paper-tree")
        algorithm = next(n for n in tree.root.children if str(n.label).startswith("Algorithm 1"))
        node = next(n for n in algorithm.children if str(n.label).startswith("step 5"))
        tree.select_node(node)
        await pilot.pause()
        assert {str(app.model.names[i]) for i in app.model.rows} == {"gated"} and len(app.model.rows) == 3
        # the panel names the node, not the filter's JSON list of step names ('name:[["gated", "Eq. 7"]]')
        assert panel(app) == "paper view: Algorithm 1 › step 5: 3 steps (f changes the filter)"

    run(body, mixed_path)


def test_the_filter_prompt_after_a_paper_view_choice_names_the_node(mixed_path: Path) -> None:
    """f after a choice in the paper view opened with the filter's internal text (name:[["gated", "Eq. 7"]])
    to edit; it opens empty, naming the node: escape keeps its steps, enter with nothing clears it. R names
    the node too."""
    async def body(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("p")
        await pilot.pause()
        tree = app.screen.query_one("#paper-tree")
        algorithm = next(n for n in tree.root.children if str(n.label).startswith("Algorithm 1"))
        tree.select_node(next(n for n in algorithm.children if str(n.label).startswith("step 5")))
        await pilot.pause()
        await pilot.press("R")
        await pilot.pause()
        assert panel(app).endswith("; filter paper view: Algorithm 1 › step 5: 3 shown"), panel(app)
        await pilot.press("f")
        await pilot.pause()
        prompt = app.screen.query_one(Input)
        assert prompt.value == "" and "name:" not in str(app.screen.query_one(Static).render())
        assert "now: the paper view's Algorithm 1 › step 5" in str(app.screen.query_one(Static).render())
        await pilot.press("escape")
        await pilot.pause()
        assert len(app.model.rows) == 3
        await pilot.press("f")
        await answer(pilot, "")
        assert len(app.model.rows) == app.model.n and panel(app) == f"no filter: {app.model.n} steps"
        await pilot.press("f")  # a filter typed is offered again as typed
        await answer(pilot, "picky")
        await pilot.press("f")
        await pilot.pause()
        assert app.screen.query_one(Input).value == "picky"

    run(body, mixed_path)


def test_clicking_a_row_moves_the_cursor_and_at_a_bad_step_still_opens(nan_path: Path, tmp_path: Path) -> None:
    async def body(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        assert "--at nosuch@iter=1: no step matches" in panel(app)
        await pilot.click("#timeline", offset=(10, 4))  # the fourth row below the border: step 3
        await pilot.pause()
        assert app.timeline.step_index == 3

    app = open_app(str(nan_path), start="nosuch@iter=1")
    assert isinstance(app, PdbgApp)

    async def main() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            await body(app, pilot)

    asyncio.run(main())


def test_a_newer_minor_recording_says_so_inside_the_app(nan_path: Path, tmp_path: Path) -> None:
    """`pdbg RUN` on a recording of a newer minor schema: its warning went to the terminal just before the
    full-screen app took it, and nothing in the app said that answers may differ from the newer version's."""
    from recorder.store import layout
    from tests.sealing import as_schema

    path = tmp_path / "newer.zarr"
    shutil.copytree(nan_path, path)
    newer = f"{layout.SCHEMA_MAJOR}.{layout.parse_version(layout.SCHEMA_VERSION)[1] + 1}"
    as_schema(path, newer)
    with pytest.warns(recorder.RecorderWarning):
        app = open_app(str(path))
    assert isinstance(app, PdbgApp)

    async def main() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            assert f"{path} was written by a newer PaperDebugger (schema {newer}; this one reads " \
                   f"{layout.SCHEMA_VERSION}): what the newer schema added is not read" in panel(app)

    asyncio.run(main())


def test_a_crashed_run_says_what_ended_it_and_export_refuses_an_existing_path(tmp_path: Path) -> None:
    path = tmp_path / "crashed.zarr"
    model = nanmodels.Scaled(4)
    with pytest.raises(RuntimeError), recorder.record(path, model=model):
        model(torch_ones(), 1.0)
        raise RuntimeError("training blew up")
    (tmp_path / "taken.pdbg").write_text("")

    async def body(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        assert "crashed, ended by: RuntimeError: training blew up" in panel(app)
        await pilot.press("x")
        await answer(pilot, str(tmp_path / "taken.pdbg"))
        assert "taken.pdbg already exists: give another path, or delete it first" in panel(app)

    run(body, path)


def test_the_inspector_reads_a_watch_range_per_statistic_and_stays_within_the_tensor(mixed_path: Path) -> None:
    """A watch's range [0, 1] bounds min, max, mean and absmax, says nothing of the norm, and asks
    for no NaN; o past the end shows the last element, [ goes back from there."""
    async def body(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("colon")
        await answer(pilot, "gated@iter=0")
        await pilot.press("tab")
        for _ in range(len(app.step.records)):
            tensor = pane(app).tensor()
            if tensor is not None and tensor.name == "gate":
                break
            await pilot.press("down")
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, Inspector)
        seen = {}
        for _ in Inspector.STATS:
            page = str(app.screen.query_one("#page", Static).render())
            seen[app.screen.stat] = page
            await pilot.press("t")
            await pilot.pause()
        assert "the watch's range puts absmax in [0, 1]" in seen["absmax"]
        assert "the watch's range puts max in [0, 1]" in seen["max"]
        assert "the watch's range puts nan in [0, 0]: 0 of these 3 iterations outside" in seen["nan"]
        assert "watch's range" not in seen["norm"] and "watch's range" not in seen["std"]
        await pilot.press("o")
        await answer(pilot, "999")
        assert "elements 3..3 of 4" in str(app.screen.query_one("#page", Static).render())
        await pilot.press("left_square_bracket")
        await pilot.pause()
        assert "elements 0..3 of 4" in str(app.screen.query_one("#page", Static).render())

    run(body, mixed_path)


def test_the_cursor_row_stays_in_view_when_a_result_fills_the_panel(nan_path: Path) -> None:
    """At 80x24 a replay result grows the panel and shrinks the timeline: the cursor's row is still
    on screen (it scrolled out of view)."""
    async def main() -> None:
        app = PdbgApp(replayer.open(nan_path))
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause()
            await pilot.press("g", "e")
            await answer(pilot, "args.0=x * 2")
            await app.workers.wait_for_complete()
            await pilot.pause()
            t = app.timeline
            assert t.scroll_offset.y <= t.cursor < t.scroll_offset.y + t.size.height, (t.cursor, t.scroll_offset)

    asyncio.run(main())


@recorder.paper_step("Eq. 11", description="six heads")
def six_heads(x):  # type: ignore[no-untyped-def]
    return tuple(x * k for k in range(1, 7))


def test_the_step_pane_shows_a_tensor_row_when_a_result_fills_the_panel(mixed_path: Path) -> None:
    """At 80x24 a result of six lines in the panel left the step pane (below the timeline, as tall as
    it) room for its title, notes and the tensor table's header, but no tensor: it now keeps the rows
    down to its first tensor's, and the timeline, shorter, still shows the cursor's row."""
    async def main() -> None:
        app = PdbgApp(replayer.open(mixed_path))
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press("n")  # the broken watch: a title, the description and the watch's two lines
            await pilot.pause()
            app.set_panel("\n".join(f"result line {i}" for i in range(6)))
            await pilot.pause()
            step_pane = pane(app)
            assert step_pane.view is not None and step_pane.view.notes
            first = step_pane._table_at + 1
            assert step_pane.scroll_offset.y <= first < step_pane.scroll_offset.y + step_pane.size.height
            assert step_pane.plain().splitlines()[first].startswith("input   args.0")
            t = app.timeline
            assert t.size.height >= 3 and t.scroll_offset.y <= t.cursor < t.scroll_offset.y + t.size.height
            app.set_panel("")  # the room comes back: the panes share it again
            await pilot.press("right")
            await pilot.pause()
            assert t.size.height >= step_pane.size.height - 2

    asyncio.run(main())


@recorder.paper_step("Eq. 12 (the gated residual update of the hierarchical encoder, with layer-wise scaling)",
                     algorithm="Algorithm 3", step=7, description="a long label and a long description " * 3)
def gated_update_with_a_rather_long_function_name(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


def test_a_long_titled_step_shows_its_first_tensor_at_80x24(tmp_path: Path) -> None:
    """A step with a long paper label, name and description at 80x24: its title wrapped to four lines (its
    cells were within three widths) and the room kept for the pane assumed the panel at its tallest, so no
    tensor row was in view beside a one-line panel. The title takes three lines and the first tensor shows;
    a result that fills the panel then still leaves the timeline its rows."""
    path = tmp_path / "run.zarr"
    with recorder.record(path):
        y = gated_update_with_a_rather_long_function_name(torch.randn(4, requires_grad=True))
        y.sum().backward()

    async def main() -> None:
        app = PdbgApp(replayer.open(path))
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press("right")  # the backward step: "backward · iteration 0 · call 0" in its title
            await pilot.pause()
            step_pane = pane(app)
            assert step_pane.view is not None and step_pane.view.tensors and "backward" in step_pane.view.title
            assert step_pane._table_at <= 3 + 2 + 1  # three lines of title, two of description, one blank
            first = step_pane._table_at + 1
            assert step_pane.scroll_offset.y <= first < step_pane.scroll_offset.y + step_pane.size.height
            app.set_panel("\n".join(f"result line {i}" for i in range(6)))
            await pilot.pause()
            await pilot.pause()
            assert app.timeline.size.height >= 3

    asyncio.run(main())


def test_the_paper_view_keeps_its_counts_on_an_80_column_screen(tmp_path: Path) -> None:
    """A long paper label and step name pushed a node's calls, time and anomalies past the paper view's
    right edge at 80 columns (reached only by scrolling sideways); the label gives way and they show."""
    path = tmp_path / "run.zarr"
    with recorder.record(path):
        x = torch.randn(4, requires_grad=True)
        gated_update_with_a_rather_long_function_name(x * float("nan")).sum().backward()

    async def main() -> None:
        app = PdbgApp(replayer.open(path))
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press("p")
            await pilot.pause()
            tree = app.screen.query_one("#paper-tree")
            assert tree.virtual_size.width <= tree.scrollable_content_region.width  # no sideways scroll
            node, depth = tree.root, 0
            while node.children:
                node, depth = node.children[0], depth + 1
            label = str(node.label)
            assert depth == 4 and label.startswith("gated_update") and "…" in label, label
            assert "   1/1 · " in label and label.endswith(" · 2 anomalies"), label

    asyncio.run(main())


def test_v_opens_the_whole_result_which_keys_scroll(tmp_path: Path) -> None:
    """The result panel shows a few lines (a replay's first four tensors and two warnings); it said
    nothing of the rest, which only a mouse wheel reached. It now says "v: all of it", and v opens
    the whole result (every tensor and warning) in a page that keys scroll; escape goes back."""
    from tui.app import TextScreen

    path = tmp_path / "run.zarr"
    with recorder.record(path, mode="full"):
        six_heads(torch.randn(64, 8))
    expected = replayer.replay(replayer.open(path), 0, edit={"args.0": "x * 2"})
    assert len(expected.outputs) == 6 and not expected.match

    async def main() -> None:
        app = PdbgApp(replayer.open(path))
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause()
            await pilot.press("v")  # nothing shown yet: nothing to open
            await pilot.pause()
            assert not isinstance(app.screen, TextScreen)
            await pilot.press("e")
            await answer(pilot, "args.0=x * 2")
            await app.workers.wait_for_complete()
            await pilot.pause()
            assert app.query_one("#panel", Static).border_subtitle == "v: all of it"
            names = [d.name for d in expected.outputs]
            assert [n for n in names if f"{n}:" in panel(app)] == names[:4]
            await pilot.press("v")
            await pilot.pause()
            assert isinstance(app.screen, TextScreen)
            page = str(app.screen.query_one("#page", Static).render())
            assert page.startswith("replay of step 0 with edit args.0=x * 2: MISMATCH")
            assert all(f"{n}:" in page for n in names), page
            flat = " ".join(page.split())
            assert all(" ".join(w.split()) in flat for w in expected.warnings), (expected.warnings, page)
            app.save_screenshot(str(tmp_path / "result.svg"))
            await pilot.press("escape")
            await pilot.pause()
            assert not isinstance(app.screen, TextScreen)

    asyncio.run(main())


def escaping(x):  # type: ignore[no-untyped-def]
    return x * 2


def test_terminal_escape_sequences_in_a_recording_never_reach_the_terminal(tmp_path: Path, monkeypatch) -> None:
    """A recording's names, labels and messages are data from elsewhere (a shared bundle): the
    control characters in them (an escape sequence that sets the window title or clears the
    screen, a bidirectional override) reached the terminal as they were, from the CLI and from the
    TUI. The CLI prints them escaped (\\x1b); the TUI leaves them out of what it draws."""
    import sys

    from rich.segment import Segment

    from tests.cli import pdbg
    from tui.app import _PrintableOnly

    annotate = sys.modules["recorder.annotate"]
    with pytest.raises(ValueError, match="holds a control character"):  # refused where a step is declared
        recorder.paper_step("Eq. 1", name="two\nlines")
    # A recording made elsewhere (a bundle someone sends, hand-made) may still hold them.
    monkeypatch.setattr(annotate, "_check_label", lambda label, **texts: None)
    step = recorder.paper_step("Eq. \x1b[31mRED\x1b[0m", name="esc\x1b]0;title\x07name",
                               description="desc \x1b[2J\u202ecleared")(escaping)
    path = tmp_path / "run.zarr"
    with recorder.record(path, mode="full"):
        step(torch.ones(3))
    for args in (("info", str(path)), ("find", str(path), "*"), ("verify", str(path))):
        res = pdbg(*args, cwd=tmp_path)  # (verify: the step is no paper step here, and is listed as not replayed)
        assert res.returncode == (2 if args[0] == "verify" else 0), res.stderr
        assert not any(c in res.stdout + res.stderr for c in "\x1b\x07\u202e"), res.stdout
        assert "esc\\x1b]0;title\\x07name" in res.stdout and "Eq. \\x1b[31mRED\\x1b[0m" in res.stdout
    drawn = _PrintableOnly().apply([Segment("a\x1b[31mb\x07\u202ec", None), Segment("\x1b[?25l", None, [(1,)])], None)
    assert drawn[0].text == "a[31mbc" and drawn[1].text == "\x1b[?25l"  # Textual's own control segments pass
    assert any(isinstance(f, _PrintableOnly) for f in PdbgApp(replayer.open(path))._filters)


def test_a_narrow_step_pane_keeps_the_nan_and_inf_counts(nan_path: Path) -> None:
    """At 140 columns the step pane is ~52 wide: Rich squeezed the tensor table and cut its last
    columns to "…", so the origin's Inf count was not on screen. Columns now give way whole, least
    needed first; NaN and Inf stay, at every width the TUI supports."""
    origin = replayer.first_nonfinite(replayer.open(nan_path)).step
    out = next(r for r in origin.records if r.role == "output")
    for size in ((80, 24), (140, 40), (200, 50)):
        async def main(size: tuple[int, int] = size) -> None:
            app = PdbgApp(replayer.open(nan_path))
            async with app.run_test(size=size) as pilot:
                await pilot.pause()
                await pilot.press("g")
                await pilot.pause()
                lines = pane(app).plain().splitlines()
                header = next(line for line in lines if line.lstrip().startswith("role"))
                assert header.split()[-2:] == ["NaN", "Inf"] and "…" not in header, (size, header)
                row = next(line for line in lines if line.lstrip().startswith(f"output  {out.name}"))
                assert row.split()[-2:] == [str(int(out.stats["nan"])), str(int(out.stats["inf"]))], (size, row)

        asyncio.run(main())


@recorder.paper_step("Eq. 12", name="loss, total (weighted)")
def odd_named(x):  # type: ignore[no-untyped-def]
    return x.sum()


def test_a_paper_node_of_a_name_with_spaces_and_commas_filters_to_its_steps(tmp_path: Path) -> None:
    """The paper view's filter split names on spaces and commas: a step named "loss, total
    (weighted)" kept 0 steps. Its node now keeps exactly its steps."""
    path = tmp_path / "run.zarr"
    with recorder.record(path) as session:
        for _ in range(2):
            odd_named(torch.ones(2))
            odd_named(torch.zeros(2))
            session.next_iteration()

    async def body(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("p")
        await pilot.pause()
        tree = app.screen.query_one("#paper-tree")
        nodes = [tree.root]
        while not any(str(n.label).startswith("loss, total (weighted)") for n in nodes):
            nodes = [c for n in nodes for c in n.children]
        tree.select_node(next(n for n in nodes if str(n.label).startswith("loss, total (weighted)")))
        await pilot.pause()
        assert [str(app.model.names[i]) for i in app.model.rows] == ["loss, total (weighted)"] * 4

    run(body, path)


@recorder.paper_step("Eq. 13")
def every_other(x):  # type: ignore[no-untyped-def]
    return x * 2


def test_iteration_keys_pass_over_iterations_without_steps(tmp_path: Path) -> None:
    """A step recorded on iterations 0, 2 and 4 only: ] from iteration 0 said "no other
    iteration"; it goes to iteration 2, then 4, and [ comes back."""
    path = tmp_path / "run.zarr"
    with recorder.record(path) as session:
        for i in range(5):
            if i % 2 == 0:
                every_other(torch.ones(2))
            session.next_iteration()

    async def body(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        seen = [int(app.model.iteration[app.timeline.step_index])]
        for key in ("right_square_bracket", "right_square_bracket", "right_square_bracket",
                    "left_square_bracket", "left_square_bracket"):
            await pilot.press(key)
            await pilot.pause()
            seen.append(int(app.model.iteration[app.timeline.step_index]))
        assert seen == [0, 2, 4, 4, 2, 0], seen

    run(body, path)


def _attention(label: str) -> type:
    """A paper step class named Attention (two modules of a model may each have one)."""
    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):  # type: ignore[no-untyped-def]
            return torch.tanh(self.fc(x))

    return recorder.paper_step(label)(Attention)


def test_steps_of_two_classes_sharing_a_name_stay_apart(tmp_path: Path) -> None:
    """An encoder's Attention (Eq. 3) and a decoder's (Eq. 5): pdbg info and the paper view listed
    one "Attention" row labelled Eq. 3 with both classes' calls, and Eq. 5's calls were numbered
    after Eq. 3's (its first call was #1: "Eq. 5#0" matched nothing). Each now has its own row, node
    and call numbers."""
    import json

    from tests.cli import pdbg

    enc, dec = _attention("Eq. 3")(), _attention("Eq. 5")()
    path = tmp_path / "run.zarr"
    with recorder.record(path) as session:
        for _ in range(2):
            dec(enc(torch.randn(2, 4))).sum().backward()
            session.next_iteration()
    rec = replayer.open(path)
    assert rec.step("Eq. 5#0").paper["label"] == "Eq. 5" and rec.step("Eq. 5#0").call == 0
    info = json.loads(pdbg("info", str(path), "--json", cwd=tmp_path).stdout)
    assert [(p["name"], p["paper"]["label"], p["forward_calls"]) for p in info["paper_steps"]] == [
        ("_attention.<locals>.Attention", "Eq. 3", 2), ("_attention.<locals>.Attention", "Eq. 5", 2)]

    async def body(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("p")
        await pilot.pause()
        tree = app.screen.query_one("#paper-tree")
        eq5 = next(n for n in tree.root.children if str(n.label).startswith("Eq. 5"))
        tree.select_node(eq5)
        await pilot.pause()
        assert {app.model.labels[i] for i in app.model.rows} == {"Eq. 5"} and len(app.model.rows) == 4

    run(body, path)


def test_the_inspector_slice_fits_an_80_column_screen(nan_path: Path) -> None:
    """At 80 columns the inspector printed 8 values a row and the rows wrapped, breaking the
    element-index column; it now prints as many as fit."""
    async def main() -> None:
        app = PdbgApp(replayer.open(nan_path))
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause()
            await pilot.press("g", "enter")
            await pilot.pause()
            inspector = app.screen
            assert isinstance(inspector, Inspector)
            page = inspector.query_one("#page", Static)
            rows = [line for line in str(page.render()).splitlines() if line.strip()[:1].isdigit() and ": " in line]
            assert rows and all(len(line) <= page.size.width for line in rows), (page.size.width, rows)
            first = [line.split(":")[0].strip() for line in rows[:2]]
            per_row = int(first[1]) - int(first[0])
            assert per_row == inspector.per_row < 8

    asyncio.run(main())


def test_the_inspector_reads_a_large_tensor_without_freezing_the_screen(nan_path: Path, monkeypatch) -> None:
    """A tensor above Inspector.BIG elements (a 200 MB one took ~3 s a key on the screen's thread) is
    read and summarised in a worker: the page says it is reading, the screen answers keys meanwhile,
    and the view comes; closed before it comes, nothing breaks."""
    from tui import views as views_mod

    monkeypatch.setattr(Inspector, "BIG", 4)
    release = threading.Event()
    real = views_mod.tensor_view

    def slow_view(*args, **kwargs):  # type: ignore[no-untyped-def]
        release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(views_mod, "tensor_view", slow_view)

    async def main() -> None:
        app = PdbgApp(replayer.open(nan_path))
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause()
            await pilot.press("g", "enter")
            await pilot.pause()
            assert isinstance(app.screen, Inspector)
            page = app.screen.query_one("#page", Static)
            assert str(page.render()).startswith("reading input args.0 (12 elements) …")
            await pilot.press("t")  # the screen answers while the worker reads
            release.set()
            await app.workers.wait_for_complete()
            await pilot.pause()
            assert app.screen.stat == "max" and "histogram of finite values" in str(page.render())
            release.clear()
            await pilot.press("t")
            await pilot.press("escape")  # closed before the worker is done
            release.set()
            await app.workers.wait_for_complete()
            await pilot.pause()
            assert not isinstance(app.screen, Inspector)

    asyncio.run(main())


def test_the_footer_keys_fit_an_80_column_screen(nan_path: Path) -> None:
    """At 80 columns the command palette's key, docked on the right of the footer, was drawn over
    "b bisect", and "? keys" and "q quit" lay past the edge. The keys now go compact there, without the
    palette's (ctrl+p, which the start's panel names); at 120 columns the footer is as before."""
    from textual.widgets import Footer
    from textual.widgets._footer import FooterKey

    async def keys_at(width: int) -> list[tuple[str, int, int]]:
        app = PdbgApp(replayer.open(nan_path))
        async with app.run_test(size=(width, 24)) as pilot:
            await pilot.pause()
            footer = app.screen.query_one(Footer)
            return [(k.key, k.region.x, k.region.right) for k in footer.query(FooterKey)]

    narrow = asyncio.run(keys_at(80))
    assert {"question_mark", "q", "b"} <= {key for key, _, _ in narrow}
    assert all(right <= 80 for _, _, right in narrow), narrow
    spans = sorted((x, right) for _, x, right in narrow)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans  # none drawn over another
    assert "ctrl+p" in {key for key, _, _ in asyncio.run(keys_at(120))}


def test_timeline_rows_keep_their_duration_on_an_80_column_screen(nan_path: Path) -> None:
    """At 80 columns the timeline's rows were cut before their duration ("6.5" of "6.5ms"): the
    module path's column narrows instead."""
    async def main() -> None:
        app = PdbgApp(replayer.open(nan_path))
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause()
            t = app.timeline
            room = t.scrollable_content_region.width  # (the scroll bar covers what is past it)
            lines = ["".join(s.text for s in t.render_line(y))[:room].rstrip() for y in range(t.size.height)]
            shown = [line for line in lines if line.strip()]
            assert shown and all(line.endswith("s") for line in shown), shown

    asyncio.run(main())


def test_the_step_pane_follows_a_jump_that_clears_the_filter_onto_the_same_row(nan_path: Path) -> None:
    """With the filter phase:backward, the cursor on its fourth row (step 8), `:3` clears the filter
    and puts the cursor on step 3, the fourth row again: the pane kept showing step 8 (its tensors,
    `r`'s and enter's target), and enter on a tensor step 3 does not have ended the app."""
    async def body(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        app.apply_filter("phase:backward")
        for _ in range(3):
            await pilot.press("down")
        await pilot.pause()
        assert app.timeline.step_index == 8 and pane(app).border_title.startswith("step 8 ")
        await pilot.press("colon")
        await answer(pilot, "3")
        assert app.model.filter_text == "" and app.timeline.step_index == 3
        assert pane(app).border_title.startswith("step 3 ") and "Scaled" in pane(app).title.plain
        await pilot.press("tab", "down", "enter")
        await pilot.pause()
        assert app.is_running and isinstance(app.screen, Inspector)
        assert " · step 3" in str(app.screen.query_one("#page", Static).render())

    run(body, nan_path)


def test_iteration_and_anomaly_keys_stay_among_the_filtered_steps(nan_path: Path) -> None:
    """`]`, `[`, `n` and `N` went to steps the filter hid, and cleared it; h/l, Home/End and the page
    keys kept to it. The answer at an edge is cleared by the next move (it said "no further
    anomaly after this step" at step 0, with anomalies after it)."""
    async def body(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        app.apply_filter("smooth_relu")
        await pilot.pause()
        assert app.timeline.step_index == 2
        for key, expected in (("right_square_bracket", 12), ("left_square_bracket", 2), ("n", 12), ("n", 14),
                              ("N", 12)):
            await pilot.press(key)
            await pilot.pause()
            assert app.timeline.step_index == expected, key
            assert app.model.filter_text == "smooth_relu" and app.step.name == "smooth_relu"
        await pilot.press("end", "n")
        await pilot.pause()
        assert app.timeline.step_index == 19 and panel(app) == (
            "no further anomaly after this step among the steps the filter shows")
        await pilot.press("right_square_bracket")
        assert panel(app) == "no later iteration among the steps the filter shows"
        await pilot.press("home")
        await pilot.pause()
        assert app.timeline.step_index == 2 and panel(app) == ""

    run(body, nan_path)


def test_the_sparkline_draws_the_iterations_around_the_step(tmp_path: Path) -> None:
    """The inspector drew the last 60 of the run's last 200 calls whatever the step: the iteration at
    the cursor was never in it, and an evaluation's no-grad calls (call 0 of the iteration after an
    epoch) were drawn among the training's call 0."""
    from tests.replayer.test_replay import Shared
    from tui.app import render_tensor

    layer = Shared()
    path = tmp_path / "run.zarr"
    with recorder.record(path, model=layer) as run:
        for i in range(130):
            if i % 40 == 0 and i:
                with torch.no_grad():
                    layer(torch.full((1, 4), 1e3))  # an evaluation batch, larger than any training one
            layer(torch.full((1, 4), float(i))).sum().backward()
            run.next_iteration()
    rec = replayer.open(path)
    for iteration, drawn, at in ((50, (20, 79), 30), (0, (0, 59), 0), (129, (70, 129), 59)):
        step = rec.step(f"Eq. 4@iter={iteration}#{1 if iteration in (40, 80, 120) else 0}")
        assert step.grad_enabled
        view = views.tensor_view(step, "args.0", "input", stat="max")
        assert [it for it, _ in view.series] == list(range(drawn[0], drawn[1] + 1)), iteration
        assert view.series[view.series_at] == (iteration, float(iteration)) and view.series_at == at
        text = render_tensor(view)
        assert f"max across iterations {drawn[0]}…{drawn[1]} (this one underlined): " in text.plain
        start = text.plain.index("(this one underlined): ") + len("(this one underlined): ")
        assert len(text.plain[start:].splitlines()[0]) == 60
        marked = [span.start - start for span in text.spans if "underline" in str(span.style)]
        assert marked == [at], (iteration, marked)
    evaluation = rec.step("Eq. 4@iter=80#0")
    assert not evaluation.grad_enabled and "forward (no grad)" in repr(evaluation)
    view = views.tensor_view(evaluation, "args.0", "input", stat="max")
    assert view.series == [(40, 1e3), (80, 1e3), (120, 1e3)] and view.series_at == 1


@recorder.paper_step("Eq. 3", description="softmax of edge scores")
def _edge_softmax(e: torch.Tensor) -> torch.Tensor:
    return torch.softmax(e, 0)


def test_the_sparkline_marks_no_elements_and_nan_apart(tmp_path: Path) -> None:
    """A graph without edges (zero-size scores: an absmax of NaN, no elements) was drawn ✗, the
    non-finite mark, and the iteration whose result held NaN a normal bar (absmax is over the finite
    values). Each has its own mark, and a legend says which is which."""
    from tui.app import render_tensor

    path = tmp_path / "run.zarr"
    with recorder.record(path) as run:
        for e in (torch.ones(3), torch.ones(0), torch.tensor([1.0, 2.0, 4.0]), torch.tensor([float("-inf")] * 2)):
            _edge_softmax(e)  # (the last: all masked, exp(-inf - -inf) = NaN)
            run.next_iteration()
    rec = replayer.open(path)
    view = views.tensor_view(rec.step("Eq. 3@iter=3"), "output", "output")
    assert view.series_marks == ["", views.EMPTY, "", views.NONFINITE]
    assert views.sparkline([v for _, v in view.series], view.series_marks) == "▁∅█✗"
    text = render_tensor(view).plain
    assert "absmax across iterations 0…3 (this one underlined): ▁∅█✗   ✗ held NaN or Inf, ∅ no elements\n" in text
    assert views.sparkline([1.0, float("nan"), 3.0]) == "▁✗█"  # (without marks: what is not finite, as before)


def test_the_sparkline_legend_goes_below_where_it_would_not_fit(tmp_path: Path) -> None:
    """At 80 columns the legend after the sparkline wrapped in the middle: its "✗" stayed after the
    sparkline, "held NaN or Inf" went under the label. Where it does not fit, it has a line of its own."""
    path = tmp_path / "run.zarr"
    with recorder.record(path) as run:
        for e in (torch.ones(3), torch.ones(0), torch.tensor([1.0, 2.0, 4.0]), torch.tensor([float("-inf")] * 2)):
            _edge_softmax(e)
            run.next_iteration()

    async def page_at(width: int) -> str:
        app = PdbgApp(replayer.open(path))
        async with app.run_test(size=(width, 30)) as pilot:
            await pilot.press("end", "enter")  # the last call's args.0: [-inf, -inf]
            await pilot.pause()
            assert isinstance(app.screen, Inspector)
            return str(app.screen.query_one("#page", Static).render())

    narrow, wide = asyncio.run(page_at(80)), asyncio.run(page_at(160))
    assert "(this one underlined): ▁∅█✗\n  ✗ held NaN or Inf, ∅ no elements\n" in narrow
    assert "(this one underlined): ▁∅█✗   ✗ held NaN or Inf, ∅ no elements\n" in wide


@pytest.mark.filterwarnings("ignore:Sparse invariant checks", "ignore:Sparse CSR tensor support")
def test_a_step_returning_a_sparse_tensor_replays_and_bundles_in_the_app(tmp_path: Path) -> None:
    """r, b and x on a step returning a sparse tensor (a GCN's adjacency) crashed the app (WorkerFailed:
    "Cannot access data pointer of Tensor that doesn't have storage"), and then reported a match by the
    statistics of its stored values only. They report a bitwise match (its parts were kept), and the
    operation that made its Inf, counted over its stored values; the inspector says the tensor is sparse,
    how many values it stores and which records hold its parts, where it said only "statistics only (no
    payload recorded)"."""
    from tests.replayer.test_sparse import EDGES, _sym_norm
    from tui.app import render_tensor

    path = tmp_path / "run.zarr"
    with recorder.record(path, mode="full") as session:
        for kind in ("coo", "csr"):
            _sym_norm(EDGES, 4, kind)
            session.next_iteration()
        _sym_norm(EDGES[:, EDGES[1] != 0], 4)  # node 0 without incoming edges: 1/sqrt(0) in the edge 0 -> 1
    view = views.tensor_view(replayer.open(path).step(1), "output", "output")
    assert view.slice_text == ("a sparse_csr tensor of 8 stored values: statistics of its stored values; its indices "
                               "and values are the records output:crow_indices, output:col_indices, output:values")
    assert view.slice_text in render_tensor(view).plain

    async def body(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("r")
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert panel(app).startswith("replay of step 0: bitwise match\n  output: equal"), panel(app)
        await pilot.press("x")
        await answer(pilot, str(tmp_path / "b.pdbg"))
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert "verified: replays bit for bit" in panel(app), panel(app)
        await pilot.press("b")
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert app.timeline.step_index == 2 and "produced output (1 Inf of 6 stored values) from finite inputs" in \
            panel(app) and "operation: aten::rsqrt" in panel(app), panel(app)

    run(body, path)


@pytest.mark.filterwarnings("ignore:Sparse invariant checks", "ignore:Sparse CSR tensor support")
def test_a_step_given_a_sparse_adjacency_replays_in_the_app(tmp_path: Path) -> None:
    """r on a step given a sparse adjacency (a GCN's propagation) said the step cannot be replayed (the
    recorder kept the adjacency's statistics only): it replays bit for bit, from the adjacency's parts."""
    from tests.replayer.test_sparse import EDGES, _propagate

    path = tmp_path / "run.zarr"
    with recorder.record(path, mode="full") as session:
        for adj in (torch.sparse_coo_tensor(EDGES, torch.arange(1.0, 9.0), (4, 4)),
                    torch.sparse_coo_tensor(EDGES, torch.arange(1.0, 9.0), (4, 4)).coalesce().to_sparse_csr()):
            _propagate(adj, torch.ones(4, 2))
            session.next_iteration()

    async def body(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        for index in (0, 1):  # (a COO adjacency, then a CSR one)
            if index:
                await pilot.press("right")
            assert app.timeline.step_index == index
            await pilot.press("r")
            await app.workers.wait_for_complete()
            await pilot.pause()
            assert panel(app).startswith(f"replay of step {index}: bitwise match\n  output: equal"), panel(app)

    run(body, path)


def test_a_filter_term_with_a_value_it_cannot_have_is_refused_and_the_filter_stays(nan_path: Path) -> None:
    """`status:nan`, `phase:fwd` and `iter:abc` matched no step, silently, as if none were so."""
    async def body(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        app.apply_filter("smooth_relu")
        for term, message in (("status:nan", "filter 'status:nan': status is one of ok, alert, nonfinite, exception"),
                              ("phase:fwd", "filter 'phase:fwd': phase is one of forward, backward"),
                              ("iter:abc", "filter 'iter:abc': iter takes an iteration number, e.g. iter:5")):
            app.apply_filter(f"smooth_relu {term}")
            await pilot.pause()
            assert panel(app) == message and app.model.filter_text == "smooth_relu" and len(app.model.rows) == 8

    run(body, nan_path)


def test_an_empty_recording_says_so_and_actions_say_there_is_no_step(tmp_path: Path) -> None:
    """A complete recording with no step said "no steps committed yet (R refreshes)"; e, s and x
    opened their prompts and then did nothing."""
    path = tmp_path / "empty.zarr"
    with recorder.record(path):
        pass

    async def body(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        assert pane(app).plain().strip() == "no steps: the recording is complete and holds none"
        assert app.sub_title.startswith("complete · 0 steps · ")
        for key, what in (("e", "edit"), ("s", "swap"), ("x", "export"), ("r", "replay")):
            await pilot.press(key)
            await pilot.pause()
            assert app.screen is app.screen_stack[0] and panel(app) == f"no step at the cursor to {what}", key

    run(body, path)


def test_n_passes_over_inf_a_mask_makes_at_every_call(tmp_path: Path) -> None:
    """`n` stopped at every -inf mask step (twice an iteration in a transformer) before the real NaN,
    though bisect does not count them: it goes to the softmax that overflowed."""
    from tests.replayer.test_bisect import causal_mask, naive_softmax

    path = tmp_path / "run.zarr"
    torch.manual_seed(0)
    q = torch.nn.Linear(8, 8)
    with recorder.record(path, model=q) as recording:
        for i in range(5):
            h = q(torch.randn(6, 8) * (1e4 if i == 3 else 1.0))
            naive_softmax(causal_mask(h @ h.T))
            recording.next_iteration()

    async def body(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        assert app.rec.step(0).name == "causal_mask" and app.rec.step(0).status == "nonfinite"
        await pilot.press("n")
        await pilot.pause()
        assert (app.step.name, app.step.status) == ("naive_softmax", "nonfinite"), app.step
        await pilot.press("g")
        await pilot.pause()
        assert app.step.name == "naive_softmax"
        # the paper view counts the softmax's overflows as anomalies, not the mask's Inf at every call
        tree = views.paper_tree(app.model)
        counts = {name: node.alerts for name, node in tree.children.items()}
        assert counts == {"Eq. 3": 0, "Eq. 4": 1}, counts  # causal_mask, naive_softmax

    run(body, path)


def test_no_color_draws_every_screen(nan_path: Path, monkeypatch) -> None:
    """NO_COLOR=1 (textual then draws in monochrome): the app crashed on its first frame, on the blank
    lines and padding it drew without a style. Every screen draws, and the keys still work."""
    monkeypatch.setenv("NO_COLOR", "1")

    async def body(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        assert app.no_color
        for key in ("g", "enter", "t", "escape", "p", "escape", "question_mark", "escape", "a", "escape", "r"):
            await pilot.press(key)
            await pilot.pause()
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert app.is_running and app.step.index == 12
        assert "replay of step 12: bitwise match" in panel(app), panel(app)

    run(body, nan_path)


def test_no_color_draws_alarms_reversed(nan_path: Path, monkeypatch) -> None:
    """NO_COLOR turns every colour into its grey: the red of a NaN count, of the "nonfinite" status and
    of the origin's row became dark greys on a dark background, harder to see than plain text. They are
    drawn reversed; the backward arrows (magenta) and the step's code (no colours) are not."""
    monkeypatch.setenv("NO_COLOR", "1")

    def drawn(app: PdbgApp, strip) -> list:  # type: ignore[no-untyped-def]
        for line_filter in app._filters:  # as textual's compositor applies them
            strip = strip.apply_filter(line_filter, Color(0, 0, 0))
        return list(strip)

    async def body(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("n")
        await pilot.pause()
        step = pane(app)
        segments = [seg for y in range(step.size.height) for seg in drawn(app, step.render_line(y))]
        alarms = {seg.text.strip() for seg in segments if seg.style and seg.style.reverse}
        assert {"nonfinite", "2", "3"} <= alarms, alarms  # the status, the output's NaN and Inf counts
        timeline = app.query_one(Timeline)
        backward = [seg for y in range(timeline.size.height) for seg in drawn(app, timeline.render_line(y))
                    if seg.text.strip() == "←"]
        assert backward and not any(seg.style.reverse for seg in backward)
        await pilot.press("k")  # smooth_relu's backward: its code under the table
        await pilot.pause()
        segments = [seg for y in range(step.size.height) for seg in drawn(app, step.render_line(y))]
        assert any("log1p" in seg.text for seg in segments)
        assert not any(seg.style and seg.style.reverse for seg in segments), [seg for seg in segments
                                                                              if seg.style and seg.style.reverse]

    run(body, nan_path)


def test_alerts_list_the_exception_that_ended_the_run_outside_every_step(tmp_path: Path) -> None:
    """A run that died of an exception raised between recorded steps (an out-of-range label in the loss):
    the opening panel said "crashed, ended by: IndexError", and the alerts pane "no non-finite values,
    exceptions or broken expectations recorded"."""
    path = tmp_path / "run.zarr"
    model = torch.nn.Sequential(torch.nn.Linear(4, 2))
    with pytest.raises(IndexError), recorder.record(path, model=model, modules=["0"]):
        for i in range(2):
            model(torch.ones(1, 4)).sum().backward()
            if i == 1:
                raise IndexError("Target 7 is out of bounds.")

    async def body(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("a")
        await pilot.pause()
        page = str(app.screen.query_one("#page", Static).render())
        assert "no non-finite values, exceptions" not in page, page
        assert "exception" in page and "the run ended by IndexError: Target 7 is out of bounds." in page, page

    run(body, path)


def test_the_timeline_says_which_module_object_ran_and_filters_one(tmp_path: Path) -> None:
    """A student and its EMA teacher (deepcopy: one class, one module path) ran as one step: each row
    and the step pane say which object, and the filter object:K keeps one's calls."""
    path = record_ema(tmp_path / "ema.zarr", blow_up=2)

    async def body(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        rows = [app.model.row(i) for i in range(3)]
        assert ["object 1 of 2" in "".join(t for t, _ in r) for r in rows] == [True, False, False]
        assert all("object 2 of 2" in "".join(t for t, _ in r) for r in rows[1:])
        await pilot.press("g")
        await pilot.pause()
        title = pane(app).plain().splitlines()[0]
        assert title.startswith("Eq. 3 · ProjectionHead · object 1 of 2 · forward (no grad)"), title
        app.apply_filter("object:2")
        await pilot.pause()
        assert len(app.model.rows) == 10 and all(app.rec.step(int(i)).module_object == (2, 2) for i in app.model.rows)
        app.apply_filter("object:teacher")
        await pilot.pause()
        assert panel(app).startswith("filter 'object:teacher': object takes a module object's number, e.g. object:2")
        assert app.model.filter_text == "object:2"

    run(body, path)


def test_the_step_pane_marks_the_parameters_frozen_at_the_call(tmp_path: Path) -> None:
    """Fine-tuning with a frozen embedding and backbone: every parameter was listed alike, and a
    backward step had gradients for some and none for others with nothing saying why, though each
    parameter record keeps its requires_grad. A frozen one is marked, the step says which were
    frozen at that call (the backbone thaws at iteration 2), and the inspector's title too."""
    path = record_fine_tuning(tmp_path / "ft.zarr")
    shot = os.environ.get("PDBG_FROZEN_SCREENSHOT")  # (a picture of the pane, to look at)

    async def body(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        lines = pane(app).plain().splitlines()
        assert "3 of 5 parameters frozen (requires_grad=False: they get no gradient): embed.weight, " \
            "backbone.weight, backbone.bias" in " ".join(pane(app).plain().split())
        params = [line.split() for line in lines if "param" in line.split()[:2]]  # (role, name, ...)
        assert [(words[0] == "frozen", words[2 if words[0] == "frozen" else 1]) for words in params] == [
            (True, "embed.weight"), (True, "backbone.weight"), (True, "backbone.bias"), (False, "head.weight"),
            (False, "head.bias")], params
        if shot:
            app.save_screenshot(shot)
        await pilot.press("right")  # its backward step: gradients for the head only
        await pilot.pause()
        assert "no gradient for 3 of 5 parameters: frozen at the forward call (requires_grad=False): embed.weight, " \
            "backbone.weight, backbone.bias" in " ".join(pane(app).plain().split())  # (wrapped at the pane's width)
        assert [r.name for r in pane(app).view.tensors if r.role == "param_grad"] == ["head.bias", "head.weight"]
        await pilot.press("]", "]")  # iteration 2: the backbone thawed
        await pilot.pause()
        assert app.timeline.step_index == 4
        text = pane(app).plain()
        assert "1 of 5 parameters frozen (requires_grad=False: they get no gradient): embed.weight" in \
            " ".join(text.split())
        assert [line.split()[:2] for line in text.splitlines() if "backbone.weight" in line] == [["param",
                                                                                                 "backbone.weight"]]
        await pilot.press("tab")
        chosen = next(i for i, t in enumerate(pane(app).view.tensors) if t.name == "embed.weight")
        for _ in range(chosen):
            await pilot.press("down")
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, Inspector)
        assert "param embed.weight (frozen: requires_grad=False) · 16×8 float32 · step 4" in \
            str(app.screen.query_one("#page", Static).render())

    run(body, path)


@recorder.paper_step("Eq. 4", description="inverse-frequency class weights (numpy)")
def np_class_weights(counts: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        w = counts.sum() / (counts * len(counts))
        return w / w.sum()  # a zero count: inf / inf = nan


@recorder.paper_step("Eq. 2", description="a weighted loss, weights given in numpy")
def np_weighted(x: torch.Tensor, weights: np.ndarray) -> torch.Tensor:
    return (x * torch.from_numpy(weights)).sum()


def test_the_step_pane_shows_numpy_values_and_their_nan(tmp_path: Path) -> None:
    """A step whose data is numpy said "no tensors recorded for this step" and never showed its NaN
    output; at the step that used it, the NaN-bearing numpy argument showed as ``ndarray(...)``. The
    pane now lists each numpy value with its dtype, shape, first values, range and NaN/Inf count."""
    path = tmp_path / "run.zarr"
    with recorder.record(path, mode="full"):
        weights = np_class_weights(np.array([3, 0, 5, 2], dtype=np.float64))
        np_weighted(torch.ones(4, dtype=torch.float64), weights)

    async def main() -> None:
        app = PdbgApp(replayer.open(path))
        async with app.run_test(size=(160, 40)) as pilot:
            await pilot.pause()
            app.timeline.go_to(0)
            await pilot.pause()
            text = pane(app).plain()
            assert "no tensors recorded for this step" in text and "numpy values" in text
            lines = [" ".join(line.split()) for line in text.splitlines()]
            assert "args.0 float64[4] [3, 0, 5, 2] min 0 max 5" in lines, text
            assert "output float64[4] [0, nan, 0, 0] min 0 max 0 (1 NaN)" in lines, text
            app.save_screenshot(str(tmp_path / "weights.svg"))
            app.timeline.go_to(1)
            await pilot.pause()
            text = pane(app).plain()
            assert "args.1 float64[4] [0, nan, 0, 0] min 0 max 0 (1 NaN)" in [" ".join(x.split())
                                                                           for x in text.splitlines()], text
            assert "ndarray float64[4] [0, nan, 0, 0] (1 NaN)" in " ".join(text.split()), text

    asyncio.run(main())


@recorder.paper_step("Eq. 9", description="inverse-square-root learning rate")
def inv_sqrt_lr(step: int, base_lr: float) -> float:
    with np.errstate(divide="ignore"):
        return float(base_lr / np.sqrt(np.float64(step)))  # step 0: inf


def test_the_step_pane_shows_a_float_a_step_returned(tmp_path: Path) -> None:
    """A learning-rate schedule returning inf was marked nonfinite, and its pane said only "no tensors
    recorded for this step", never the value it returned; it shows it, red where it is NaN/Inf."""
    path = tmp_path / "run.zarr"
    with recorder.record(path, mode="full"):
        inv_sqrt_lr(4, 1e-3)
        inv_sqrt_lr(0, 1e-3)

    async def main() -> None:
        app = PdbgApp(replayer.open(path))
        async with app.run_test(size=(160, 40)) as pilot:
            await pilot.pause()
            lines = []
            for index in (0, 1):
                app.timeline.go_to(index)
                await pilot.pause()
                text = pane(app).plain()
                assert "no tensors recorded for this step" in text, text
                lines.append(next((" ".join(x.split()) for x in text.splitlines() if x.startswith("output")), None))
            assert lines == ["output 0.0005", "output inf (1 Inf)"], lines

    asyncio.run(main())


@recorder.paper_step("Eq. 6", description="phase-only spectrum, scaled")
def phase_gain(xf: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
    recorder.watch(xf, "xf", expected_range=(-5.0, 5.0), expected_mean=(0.0, 0.5))
    return xf / xf.abs() * gain  # 0 / 0 at a zero mode: NaN + NaN j


def test_a_complex_tensor_with_nan_is_inspected_by_its_magnitudes(tmp_path: Path) -> None:
    """The inspector of a complex tensor holding NaN killed the app (np.histogram of NaN: only real
    data had its NaN left out). It showed real parts while the step pane's statistics and watch()'s
    checks are of magnitudes, which nothing but docs/FORMAT.md said: the histogram, the step pane and
    the watch's alerts are now of |z| and say so, and the values show both parts."""
    path = tmp_path / "spectrum.zarr"
    xf = torch.tensor([3 + 4j, 0j, -6 + 8j, 0.5j], dtype=torch.complex64)
    with recorder.record(path, mode="full"):
        phase_gain(xf, torch.tensor([1.0, 2.0, 4.0, 8.0]))
    rec = replayer.open(path)
    step = rec.step(0)
    out = next(r for r in step.records if r.name == "output")
    view = views.tensor_view(step, "output", "output")
    assert view.edges == (out.stats["min"], out.stats["max"]) == (1.0, 8.0) and sum(view.histogram) == 3
    watched = [row.text for row in views.alerts(rec) if row.kind == "alert"]
    assert watched == ["step 0: Eq. 6 · phase_gain · forward · iteration 0 · call 0: watch xf: range of |z| expected "
                       "[-5.0, 5.0], got [0.0, 10.0]",
                       "step 0: Eq. 6 · phase_gain · forward · iteration 0 · call 0: watch xf: mean of |z| expected "
                       "[0.0, 0.5], got 3.875"], watched
    from replayer import notebook

    assert "the statistics of complex args.0, output, xf are of magnitudes |z|" in notebook.step(step)

    async def main() -> None:
        app = PdbgApp(rec)
        async with app.run_test(size=(150, 40)) as pilot:
            await pilot.pause()
            text = " ".join(pane(app).plain().split())
            assert "the statistics of complex args.0, output, xf are of magnitudes |z|" in text, text
            assert "watch xf: range of |z| expected [-5.0, 5.0]" in text, text
            await pilot.press("tab")
            for _ in range(len(step.records)):
                if pane(app).tensor().name == "output":
                    break
                await pilot.press("down")
            await pilot.press("enter")
            await pilot.pause()
            assert isinstance(app.screen, Inspector) and app.screen.per_row == 5
            page = str(app.screen.query_one("#page", Static).render())
            assert "histogram of the finite values' magnitudes |z|, 1 … 8" in page, page
            assert "complex values: the histogram and the statistics are of their magnitudes |z|" in page, page
            assert "0: 0.6+0.8j nan+nanj -2.4+3.2j 0+8j" in " ".join(page.split()), page
            assert "absmax of |z| in iteration 0" in page, page

    asyncio.run(main())


def test_digits_that_are_not_decimal_are_refused_where_a_number_is_typed(nan_path: Path) -> None:
    """A superscript `²` passes str.isdigit but not int(): the inspector's offset, the filter's `iter:`/`object:`
    and `:` with it raised ValueError and closed the app; each is now refused with a message."""
    async def body(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("g", "enter")
        await pilot.pause()
        inspector = app.screen
        assert isinstance(inspector, Inspector)
        await pilot.press("o")
        await answer(pilot, "²")
        assert app.screen is inspector and inspector.start == 0
        await pilot.press("escape")
        for term in ("iter:²", "object:²"):
            app.apply_filter(term)
            await pilot.pause()
            assert "takes" in panel(app) and app.model.filter_text == ""
        origin = app.timeline.step_index
        await pilot.press("colon")
        await answer(pilot, "²")
        assert app.timeline.step_index == origin and "²" in panel(app)

    run(body, nan_path)


def test_a_blank_search_or_filter_moves_nowhere_and_says_there_is_no_filter(nan_path: Path) -> None:
    """`/` with spaces only jumped to the next step, as if every step matched; a filter of spaces said
    "filter '  ': N steps" though none was set."""
    async def body(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("g")
        origin = app.timeline.step_index
        for key in ("slash", "backslash"):
            await pilot.press(key)
            await answer(pilot, "   ")
            assert app.timeline.step_index == origin, key
        app.apply_filter("  ")
        await pilot.pause()
        assert panel(app) == "no filter: 20 steps" and len(app.model.rows) == 20

    run(body, nan_path)


def test_an_answer_about_the_cursor_survives_the_panel_shrinking_to_show_it(nan_path: Path) -> None:
    """After a result of several lines, `n` at the last anomaly left the panel blank: the panel shrank
    to the one-line answer, the timeline grew, and its resize cleared the answer as if the cursor had moved."""
    async def body(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("end")
        app.set_panel("a result\nof\nseveral\nlines")
        await pilot.pause()
        for key, answer_text in (("n", "no further anomaly after this step"),
                                 ("right_square_bracket", "no later iteration")):
            await pilot.press(key)
            await pilot.pause()
            assert panel(app) == answer_text, key
            app.set_panel("a result\nof\nseveral\nlines")
            await pilot.pause()
        await pilot.press("left")
        await pilot.pause()
        assert panel(app) == "a result\nof\nseveral\nlines"

    run(body, nan_path)


def test_the_inspector_of_a_tensor_kept_as_statistics_only_offers_no_slice_keys(tmp_path: Path) -> None:
    """A stats-only tensor's inspector said "] [ next/previous slice · o start at element" and its footer
    offered them, though there is no slice to move; it now offers only what works there."""
    path = tmp_path / "stats.zarr"
    with recorder.record(path, mode="stats") as rec:
        for _ in range(2):
            nanmodels.smooth_relu(torch.ones(3))
            rec.next_iteration()

    async def body(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("enter")
        await pilot.pause()
        inspector = app.screen
        assert isinstance(inspector, Inspector)
        page = str(inspector.query_one("#page", Static).render())
        assert "statistics only" in page and "next/previous slice" not in page and "t statistic" in page
        shown = {b.action for _, b, enabled, _ in inspector.active_bindings.values() if enabled}
        assert "stat" in shown and not {"slice(1)", "slice(-1)", "offset"} & shown
        await pilot.press("o")
        await pilot.pause()
        assert app.screen is inspector

    run(body, path)


def test_g_goes_to_the_step_a_nan_check_raised_in(tmp_path: Path) -> None:
    """A run that ended by a step's own NaN check (FloatingPointError raised inside the step, so no recorded result
    holds the NaN): `g` showed the cause and left the cursor where it was; it goes to that step."""
    from tests.replayer.test_bisect import checked_update

    path = tmp_path / "run.zarr"
    torch.manual_seed(0)
    with pytest.raises(FloatingPointError), recorder.record(path):
        for _ in range(2):
            checked_update(torch.randn(6))
    raised_in = replayer.first_nonfinite(replayer.open(path)).raised_in
    assert raised_in is not None and raised_in.name == "checked_root"

    async def body(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        app.go_to_step(0)
        await pilot.pause()
        await pilot.press("g")
        await pilot.pause()
        assert app.timeline.step_index == raised_in.index and "which returned no result" in panel(app), panel(app)

    run(body, path)


def test_the_inspector_shows_the_recorded_statistics_of_a_tensor_kept_as_statistics_only(tmp_path: Path) -> None:
    """A stats-only tensor's inspector showed a title, "statistics only" and a sparkline, none of the numbers
    recorded (its std and norm were shown nowhere in the app); it now lists them all, within an 80-column page."""
    path = tmp_path / "stats.zarr"
    with recorder.record(path, mode="stats") as rec:
        for _ in range(2):
            nanmodels.smooth_relu(torch.tensor([3.0, -4.0, 0.0]))
            rec.next_iteration()

    async def main() -> None:
        app = PdbgApp(replayer.open(path))
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press("enter")
            await pilot.pause()
            assert isinstance(app.screen, Inspector)
            page = str(app.screen.query_one("#page", Static).render())
            stats = replayer.open(path).step(0).records[0].stats
            assert stats["norm"] == 5.0
            assert "statistics: min -4  max 3  mean -0.3333" in page
            assert f"std {views.fmt_number(stats['std'])}" in page and "absmax 4  norm 5" in page
            assert "NaN 0  Inf 0" in page
            assert max(len(line) for line in page.splitlines()) <= int(80 * 0.95) - 6

    asyncio.run(main())


def test_alerts_wrap_under_their_message_at_80_columns(nan_path: Path) -> None:
    """An alert longer than the page wrapped back to the page's first column, under its kind ("origin"),
    so the next alert's kind was hard to find; its lines now go on under its message's column."""

    async def main() -> None:
        app = PdbgApp(replayer.open(nan_path))
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press("a")
            await pilot.pause()
            page = str(app.screen.query_one("#page", Static).render()).splitlines()
            origin = next(i for i, line in enumerate(page) if line.startswith("  origin    "))
            assert page[origin + 1].startswith(" " * 12) and page[origin + 1].strip()
            assert all(len(line) <= int(80 * 0.95) - 6 for line in page)

    asyncio.run(main())


def test_a_run_whose_steps_ran_inside_fullgraph_code_says_why_it_holds_none(tmp_path: Path, capsys) -> None:
    """Steps called inside code compiled with fullgraph=True stay in the graph unrecorded (a warning says
    so while training); the recording then opened on "no steps: the recording is complete and holds none"
    and `pdbg info` said nothing of them. The recording now keeps what stayed unrecorded, and both say it."""
    from tui.cli import main as pdbg

    torch._dynamo.reset()
    path = tmp_path / "whole.zarr"
    forward = torch.compile(lambda x: nanmodels.smooth_relu(x) * 2, backend="eager", fullgraph=True)
    with pytest.warns(recorder.RecorderWarning, match="fullgraph=True"), recorder.record(path) as rec:
        for _ in range(2):
            forward(torch.ones(3))
            rec.next_iteration()
    torch._dynamo.reset()
    assert replayer.open(path).rank.final["compiled_unrecorded"] == {"count": 1, "what": ["paper step 'smooth_relu'"]}

    async def body(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        text = " ".join(pane(app).plain().split())
        assert text.startswith("no steps: the recording is complete and holds none")
        assert "not recorded: paper step 'smooth_relu' inside code torch.compile traced with fullgraph=True" in text

    run(body, path)
    assert pdbg(["info", str(path)]) == 0
    assert "Not recorded: paper step 'smooth_relu' inside code torch.compile traced with fullgraph=True" in \
        capsys.readouterr().out


def test_the_step_pane_says_a_step_kept_statistics_only_before_r_is_tried(tmp_path: Path, nan_path: Path) -> None:
    """A step of a stats-mode run (or of a flight-mode run outside its ring) looked like any other in the
    step pane: only r told, with an error, that it cannot be replayed. The pane now says so, and why."""
    path = tmp_path / "stats.zarr"
    with recorder.record(path, mode="stats"):
        nanmodels.smooth_relu(torch.ones(3))

    async def stats_only(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        text = " ".join(pane(app).plain().split())
        assert "statistics only, no tensor bytes: it cannot be replayed (the run was recorded in stats mode" in text

    async def kept(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        assert "statistics only" not in pane(app).plain()

    run(stats_only, path)
    run(kept, nan_path)


def test_a_code_line_wider_than_the_step_pane_ends_in_an_ellipsis(nan_path: Path) -> None:
    """The step's source lines were cut at the pane's edge with nothing to show it (`... / gam` read as
    whole); a line that does not fit now ends in "…", and one that fits is drawn whole."""

    async def main() -> None:
        app = PdbgApp(replayer.open(nan_path))
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press("g")
            await app.workers.wait_for_complete()
            await pilot.pause()
            lines = pane(app).plain().splitlines()
            decorator = next(line for line in lines if '@recorder.paper_step("Eq. 2"' in line)
            assert decorator.endswith("…") and "/ gamma" not in decorator
            assert not any(line.rstrip().endswith("…") for line in lines if "return " in line)

    asyncio.run(main())


def test_a_backward_step_shows_no_empty_arguments_line(nan_path: Path) -> None:
    """A backward step's pane had a line reading "arguments" and nothing after it (a backward step has
    no arguments of its own); it now has none, and a forward step keeps its arguments."""

    async def body(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        assert "arguments (<args.0>" in pane(app).plain()
        await pilot.press("end")
        await pilot.pause()
        assert app.step.phase == "backward"
        text = pane(app).plain()
        assert "grad_output" in text and not any(line.strip() == "arguments" for line in text.splitlines())
        assert "arguments" not in text

    run(body, nan_path)


def test_a_filter_of_one_step_says_one_step(nan_path: Path) -> None:
    """A filter that left one step said "1 steps"; it says "1 step", and any other count in the plural."""

    async def body(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("f")
        await answer(pilot, "iter:0 phase:backward Stack")
        assert panel(app) == "filter 'iter:0 phase:backward Stack': 1 step (f changes it)", panel(app)
        await pilot.press("f")
        await answer(pilot, "iter:0 Eq. 2")
        assert panel(app) == "filter 'iter:0 Eq. 2': 4 steps (f changes it)", panel(app)

    run(body, nan_path)


def test_edit_and_swap_on_a_step_kept_as_statistics_only_say_so_before_prompting(tmp_path: Path) -> None:
    """On a stats-mode step, e and s asked for an edit or a swap, and only after it was typed said that the
    step cannot be replayed (a swap first named its key wrong); they now say so at once, with no prompt."""
    path = tmp_path / "stats.zarr"
    with recorder.record(path, mode="stats"):
        nanmodels.smooth_relu(torch.ones(3))

    async def body(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        for key, what in (("e", "edit"), ("s", "swap in")):
            await pilot.press(key)
            await pilot.pause()
            assert not app.screen.query(Input), key
            assert panel(app).startswith(f"cannot {what} step 0 and rerun: it kept statistics only, no tensor bytes "
                                         "(the run was recorded in stats mode"), panel(app)

    run(body, path)


def test_the_header_names_a_mode_that_keeps_statistics_only(tmp_path: Path, nan_path: Path) -> None:
    """The header read "complete · 1 step · stats.zarr" for a stats-mode run, as for a full one; it now
    names stats and flight mode (whose steps r cannot all replay), at 80 columns with the file's name."""
    path = tmp_path / "stats.zarr"
    with recorder.record(path, mode="stats"):
        nanmodels.smooth_relu(torch.ones(3))

    async def main(at: Path, want: str) -> None:
        app = PdbgApp(replayer.open(at))
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause()
            assert app.sub_title.startswith(want) and app.sub_title.endswith(at.name), app.sub_title

    asyncio.run(main(path, "complete · stats mode · 1 step · "))
    asyncio.run(main(nan_path, "complete · 20 steps · "))


def test_a_what_if_result_names_the_edit_or_swap_it_tried(nan_path: Path) -> None:
    """A rerun with an edit or a swap began "replay of step 12: MISMATCH, as the intervention makes it",
    the same for every try, so that two tries' results could not be told apart; it now names what it tried."""

    async def body(app: PdbgApp, pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("g")
        await app.workers.wait_for_complete()
        await pilot.press("e")
        await answer(pilot, "args.0=x.clamp(-50, 50)")
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert panel(app).startswith("replay of step 12 with edit args.0=x.clamp(-50, 50): MISMATCH"), panel(app)
        await pilot.press("s")
        await answer(pilot, "tests.replayer.nanmodels:stable_smooth_relu")
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert panel(app).startswith("replay of step 12 with swap tests.replayer.nanmodels:stable_smooth_relu: "), \
            panel(app)
        await pilot.press("r")
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert panel(app).startswith("replay of step 12: bitwise match"), panel(app)

    run(body, nan_path)


def test_the_header_mode_gives_way_before_the_file_name_at_80_columns(tmp_path: Path) -> None:
    """With the mode in the header, a longer file name was cut at 80 columns ("…tcrash.z…"); the mode now
    gives way first, and comes back where the screen is wide enough for both."""
    path = tmp_path / "flightcrash.zarr"
    with recorder.record(path, mode="stats"):
        for _ in range(10):
            nanmodels.smooth_relu(torch.ones(3))

    async def main(width: int) -> str:
        app = PdbgApp(replayer.open(path))
        async with app.run_test(size=(width, 24)) as pilot:
            await pilot.pause()
            assert app.sub_title.endswith("/" + path.name), app.sub_title
            return str(app.sub_title)

    assert asyncio.run(main(80)).startswith("complete · 10 steps · …/")
    assert asyncio.run(main(160)).startswith("complete · stats mode · 10 steps · ")
