"""The PaperDebugger TUI: ``pdbg RUN`` (or ``pdbg tui RUN``).

Timeline on the left (every step, in execution order, nested, coloured by status), the step at the
cursor on the right. The cursor is "now": every pane shows the state as of that step. Keys:

    ←/→ h/l  step back/forward      [ ]  previous/next iteration     n N  next/previous anomaly
    g        the NaN origin          :    go to a selector            / \\  find next/previous (condition)
    f        filter the timeline     enter the tensor inspector      a    alerts   p  paper view
    r  replay  b  bisect  e  edit & rerun  s  swap & rerun  x  export a bundle  d  diff   R  refresh
    ?  every key                     ctrl+p  the command palette      q    quit
"""

from __future__ import annotations

import functools
import gc
import math
import re
import shlex
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from pygments.token import Comment, Keyword, Name, String
from rich.cells import cell_len
from rich.segment import Segment
from rich.style import Style
from rich.syntax import ANSISyntaxTheme, Syntax
from rich.table import Table
from rich.text import Text
from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.command import Hit, Hits, Provider
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.filter import LineFilter
from textual.geometry import Region, Size
from textual.reactive import reactive
from textual.screen import ModalScreen
from textual.scroll_view import ScrollView
from textual.strip import Strip
from textual.widgets import Footer, Header, Input, Static

from recorder.errors import PdbgError
from recorder.names import shown
from replayer.recording import Recording, compiled_unrecorded_note, magnitudes_note

from . import views
from .cmd_replay import split_pair

_STYLES: dict[str, Style] = {}


def _style(spec: str) -> Style:
    if spec not in _STYLES:
        _STYLES[spec] = Style.parse(spec) if spec else Style()
    return _STYLES[spec]


class Timeline(ScrollView, can_focus=True):
    """Every step, one line each, drawn from the view model: only the visible lines are formatted."""

    DEFAULT_CSS = """
    Timeline { width: 3fr; border: round $primary-darken-2; overflow-x: hidden; }
    Timeline:focus { border: round $accent; }
    """
    cursor: reactive[int] = reactive(0)  # a position in model.rows
    BINDINGS = [  # the cursor moves, not just the view (ScrollView's own keys would only scroll)
        Binding("home", "app.edge(0)", show=False), Binding("end", "app.edge(1)", show=False),
        Binding("pagedown", "app.page(1)", show=False), Binding("pageup", "app.page(-1)", show=False),
        Binding("down", "app.step(1)", show=False), Binding("up", "app.step(-1)", show=False),
        Binding("right", "app.step(1)", show=False), Binding("left", "app.step(-1)", show=False),
    ]

    def __init__(self, model: views.TimelineModel, on_move: Callable[[], None] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.model = model
        self.on_move = on_move  # called as the cursor moves, so the step pane is redrawn in the same frame
        self.virtual_size = Size(1, len(model.rows))

    def refresh_rows(self) -> None:
        self.virtual_size = Size(1, len(self.model.rows))
        self.cursor = min(self.cursor, max(0, len(self.model.rows) - 1))
        self.refresh()

    @property
    def step_index(self) -> int | None:
        rows = self.model.rows
        return int(rows[self.cursor]) if len(rows) else None

    def go_to(self, index: int) -> None:
        """Put the cursor on a step (the nearest visible one)."""
        if not len(self.model.rows):
            return
        position = self.model.position(index)
        if position == self.cursor:  # the same row, but the rows may have changed under it (a filter cleared)
            self.watch_cursor(position, position)
        else:
            self.cursor = position

    def watch_cursor(self, old: int, new: int) -> None:
        self._keep_in_view(new)
        if self.on_move is not None:
            self.on_move()

    def _keep_in_view(self, position: int) -> None:
        top = self.scroll_offset.y
        height = max(1, self.size.height)
        if position < top:
            self.scroll_to(y=position, animate=False)
        elif position >= top + height:
            self.scroll_to(y=position - height + 1, animate=False)
        self.refresh()

    def on_resize(self) -> None:
        """A result panel that grows shrinks the timeline: keep the cursor's row in view. The cursor
        has not moved, so the step is not shown again: that would clear the answer just put in the panel
        ("no further anomaly after this step"), whose change of height caused the resize."""
        self._keep_in_view(self.cursor)

    def on_click(self, event: Any) -> None:
        offset = event.get_content_offset(self)  # (None on the border)
        position = None if offset is None else self.scroll_offset.y + offset.y
        if position is not None and 0 <= position < len(self.model.rows):
            self.cursor = position

    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        position = scroll_y + y
        width = self.size.width
        if position >= len(self.model.rows):
            return Strip.blank(width, self.rich_style)
        index = int(self.model.rows[position])
        pieces = self.model.row(index, width=self.scrollable_content_region.width)
        selected = position == self.cursor
        base = _style("reverse") if selected else (
            _style("on #1c1c28") if self.model.iteration_of(index) % 2 else Style())
        segments = [Segment(text, base + _style(style)) for text, style in pieces if text]
        strip = Strip(segments).crop(scroll_x, scroll_x + width)
        return strip.extend_cell_length(width, base)


class StepPane(ScrollView, can_focus=True):
    """The step at the cursor: paper reference, notes, its tensors, arguments and code.

    Drawn with the Line API from lines made once per step (at the pane's width), so a cursor move
    redraws this pane and nothing else: no widgets are replaced, no layout changes size. With the
    focus here, up/down choose a tensor and enter (or a click on its row) opens the inspector.
    """

    DEFAULT_CSS = """
    StepPane { width: 2fr; border: round $primary-darken-2; padding: 0 1; overflow-x: hidden; overflow-y: scroll; }
    StepPane:focus { border: round $accent; }
    """
    BINDINGS = [  # the chosen tensor moves, as the timeline's cursor does (ScrollView's own keys would only scroll)
        Binding("down,j", "tensor(1)", show=False), Binding("up,k", "tensor(-1)", show=False),
        Binding("pagedown", "tensor_page(1)", show=False), Binding("pageup", "tensor_page(-1)", show=False),
        Binding("end", "tensor_edge(1)", show=False), Binding("home", "tensor_edge(0)", show=False),
        Binding("enter", "app.inspect", show=False),
    ]
    selected: reactive[int] = reactive(0, init=False)  # the chosen tensor: a position in view.tensors

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.view: views.StepView | None = None
        self.drift: str | None = None
        self.code_drift: list[str] = []  # the classes of its submodules whose code changed since recording
        self.message: Text | None = None  # shown instead of a step ("no steps committed yet")
        self.title = Text()
        self._syntax: dict[tuple[str, int | None], Text] = {}
        self._lines: list[Strip] = []
        self._width = -1  # the width the lines were made for
        self._table_at = -1  # the line of the first tensor row
        self._least: int | None = None  # the height kept below the timeline (fit_below_timeline)

    # -- contents --------------------------------------------------------------------------------
    def show(self, view: views.StepView, drift: str | None, code_drift: list[str] | None = None) -> None:
        self.view, self.drift, self.message = view, drift, None
        self.code_drift = list(code_drift or ())
        self.title = Text.assemble((view.title, "bold"), "  ", (view.status, views.STATUS_STYLE[view.status]))
        self.set_reactive(StepPane.selected, 0)
        self._changed()

    def show_message(self, message: Text | str) -> None:
        self.view, self.drift, self.code_drift = None, None, []
        self.message = self.title = message if isinstance(message, Text) else Text(message)
        self._changed()

    def _changed(self) -> None:
        self._width = -1
        self.scroll_to(y=0, animate=False)
        self._build()
        self.refresh()

    def plain(self) -> str:
        """The pane's text as drawn (at its present width), line by line."""
        self._build()
        return "\n".join(strip.text.rstrip() for strip in self._lines)

    def tensor(self) -> views.TensorRow | None:
        """The chosen tensor, if the step has any."""
        if self.view is None or not self.view.tensors:
            return None
        return self.view.tensors[min(self.selected, len(self.view.tensors) - 1)]

    def action_tensor(self, delta: int) -> None:
        """Choose the tensor ``delta`` rows on; at the table's first or last row, scroll instead: up to
        the title, down to the code below the table (with no tensors, the keys only scroll)."""
        last = len(self.view.tensors) - 1 if self.view and self.view.tensors else -1
        chosen = max(0, min(last, self.selected + delta))
        if last >= 0 and chosen != self.selected:
            self.selected = chosen
        else:
            self.scroll_to(y=self.scroll_offset.y + delta, animate=False)

    def action_tensor_page(self, delta: int) -> None:
        self.action_tensor(delta * max(1, self.scrollable_content_region.height - 1))

    def action_tensor_edge(self, end: int) -> None:
        """Home: the first tensor, the pane scrolled to its top. End: the last tensor; pressed there
        again, the end of the pane (the code)."""
        last = len(self.view.tensors) - 1 if self.view and self.view.tensors else -1
        if not end:
            self.selected = 0
            self.scroll_to(y=0, animate=False)
        elif 0 <= self.selected < last:
            self.selected = last
        else:
            self.scroll_to(y=self.max_scroll_y, animate=False)

    def watch_selected(self) -> None:
        if self._table_at >= 0:
            row = self._table_at + 1 + self.selected
            top = self._table_at if self.selected == 0 else row  # (the first row: with the columns' names)
            self.scroll_to_region(Region(0, top, 1, row + 1 - top), animate=False, immediate=True)
        self.refresh()

    def on_click(self, event: Any) -> None:
        offset = event.get_content_offset(self)
        if offset is None or self.view is None or self._table_at < 0:
            return
        row = offset.y + self.scroll_offset.y - self._table_at - 1
        if 0 <= row < len(self.view.tensors):
            self.selected = row
            self.app.action_inspect()

    # -- lines -----------------------------------------------------------------------------------
    def _build(self) -> None:
        width = self.scrollable_content_region.width
        if width <= 0 or width == self._width:
            return
        self._width = width
        console = self.app.console
        options = console.options.update_width(width)
        parts, self._table_at = self._parts(), -1
        lines: list[list[Segment]] = []
        for part in parts:
            if isinstance(part, Table):
                self._table_at = len(lines)
            lines += console.render_lines(part, options, pad=False)
        self.call_later(self.fit_below_timeline)
        # (a segment rich left without a style gets an empty one: NO_COLOR's monochrome filter reads every one's)
        self._lines = [Strip([s if s.style is not None else Segment(s.text, _PLAIN, s.control) for s in line])
                       for line in lines]
        size = Size(width, len(self._lines))
        if size == self.virtual_size:
            return
        update = getattr(self, "_scroll_update", None)  # Textual's scroll bar update, where it has one
        if update is None:
            self.virtual_size = size  # lays the screen out again
        else:  # only this pane's scroll range changed: no layout of the screen, no second frame
            self.set_reactive(StepPane.virtual_size, size)
            update(size)

    def _fitted_title(self) -> Text:
        """The title, its long parts (a paper reference, a deep module path) cut so that it takes at
        most three lines at the pane's width: on an 80-column screen the tensor table stays in view
        (the whole of each part is in the step's description below, its module path in the timeline)."""
        assert self.view is not None
        width = max(20, self._width)
        console, options = self.app.console, self.app.console.options.update_width(width)
        if cell_len(self.title.plain) <= width or len(console.render_lines(self.title, options, pad=False)) <= 3:
            return self.title  # (as wrapped: a title of 3 widths' cells took 4 lines, the table's first row below)
        parts = self.view.title.split(" · ")
        short = [p for p in parts if cell_len(p) <= 16]
        budget = 3 * width - cell_len(self.view.status) - 3 * len(parts)
        room = max(12, (budget - sum(map(cell_len, short))) // max(1, len(parts) - len(short)))
        while True:  # narrower until it fits three lines as wrapped (wrapping leaves lines part empty)
            cut = [p if cell_len(p) <= room else
                   # (a module path: its end says most)
                   views.fit_cells(p, room, keep_end="." in p and " " not in p).rstrip()
                   for p in parts]
            title = Text.assemble((" · ".join(cut), "bold"), "  ",
                                  (self.view.status, views.STATUS_STYLE[self.view.status]))
            if room <= 12 or len(console.render_lines(title, options, pad=False)) <= 3:
                return title
            room -= 4

    def _parts(self) -> list[Any]:
        if self.view is None:
            return [self.message or Text()]
        view = self.view
        parts: list[Any] = [self._fitted_title()]
        if view.description:
            parts.append(Text(view.description, style="italic"))
        parts += [Text(n, style="yellow") for n in view.notes]
        if view.frozen:
            parts.append(Text(view.frozen, style="cyan"))
        parts.append(Text())
        if view.tensors:
            parts.append(tensor_table(view, self._width))
            magnitudes = magnitudes_note([t.name for t in view.tensors if t.dtype.startswith("complex")])
            if magnitudes:
                parts.append(Text(magnitudes, style="dim"))
            if view.shards:  # (DTensors': the table's shape column says "6×8 shard")
                parts.append(Text("this rank's local shards of DTensors, their shape and statistics the shard's: "
                                  + "; ".join(view.shards), style="dim"))
        elif not view.numpy:
            parts.append(Text("no tensors recorded for this step", style="dim"))
        if view.output is not None:  # what it returned instead (a learning-rate schedule's float)
            counts = f"  ({view.output_nonfinite})" if view.output_nonfinite else ""
            parts.append(Text.assemble(("output  ", "bold"), (view.output + counts,
                                                              "bold red" if view.output_nonfinite else "")))
        if view.numpy:  # what a step whose data is numpy was given and made (the tensor table has none of it)
            parts.append(Text("numpy values" if view.tensors else "numpy values (no tensors recorded for this step)",
                              style="bold"))
            parts += [Text.assemble((f"  {name}  ", "bold"), (summary, "bold red" if bad else ""))
                      for name, summary, bad in view.numpy]
        if view.unrecorded:  # (a replay compares their type alone: never a match of their values)
            parts.append(Text(f"not recorded as data, not compared by a replay: {', '.join(view.unrecorded)}",
                              style="yellow"))
        if view.arguments:  # (a backward step has none of its own: its tensors above are what it got)
            parts.append(Text.assemble(("arguments ", "dim"), view.arguments))
        if view.source:
            where = f"{view.source_file}:{view.source_line}"
            parts.append(Text.assemble((where, "dim"), ("  " + self.drift, "bold yellow") if self.drift else "",
                                       no_wrap=True, overflow="ellipsis"))
            parts += [Text(d, style="bold yellow") for d in self.code_drift]
            key = (view.source, view.source_line)
            syntax = self._syntax.get(key)
            if syntax is None:  # highlighting is the costly part of a step change: once per code
                syntax = self._syntax[key] = highlighted(view.source, view.source_line or 1, plain=self.app.no_color)
            parts.append(syntax)
        else:
            parts.append(Text("no source recorded for this step", style="dim"))
        return parts

    def render_line(self, y: int) -> Strip:
        self._build()  # the width changed (a resize): make the lines again
        width = self.scrollable_content_region.width
        position = self.scroll_offset.y + y
        if position >= len(self._lines):
            return Strip.blank(width, self.rich_style)
        strip = self._lines[position]
        if self.view is not None and self._table_at >= 0 and position == self._table_at + 1 + self.selected:
            # over the row's own styles: the table's stripe on every second row would hide it otherwise
            mark = _style("on #264f78" if self.has_focus else "on #1f3550")
            strip = Strip(Segment.apply_style(strip, post_style=mark), strip.cell_length)
        return strip.crop(0, width).extend_cell_length(width, self.rich_style)

    def on_resize(self) -> None:
        self._build()

    def fit_below_timeline(self) -> None:
        """Below the timeline (a screen narrower than PdbgApp.WIDE), keep the height that shows the step
        down to its first tensor's row: on an 80x24 screen with a result in the panel, the two panes'
        equal shares left this one its title, notes and the table's header, and no tensor. The timeline
        keeps three rows beside the panel as it is now (PdbgApp.set_panel fits again when it changes; before
        the first layout, as at its tallest). The layout changes only when that height does."""
        narrow = self.parent is not None and self.parent.has_class("narrow")
        panels = self.screen.query("#panel")  # (its own screen's: a page may be open over it)
        panel = panels.first().outer_size.height if panels else 0
        least, room = None, self.screen.size.height - PdbgApp.BESIDE_STEP_PANE - (panel or PdbgApp.PANEL_ROWS)
        if narrow and self._table_at >= 0 and room > 0:  # (a screen shorter than 16 rows: the equal shares)
            border = self.outer_size.height - self.scrollable_content_region.height  # (min-height counts it)
            least = min(self._table_at + 2 + border, room)
        if least != self._least:
            self._least = least
            self.styles.min_height = least

    def on_focus(self) -> None:
        self.refresh()

    def on_blur(self) -> None:
        self.refresh()


_COLUMNS = ("role", "name", "shape", "dtype", "min", "max", "mean", "std", "NaN", "Inf")
# Which columns a narrow pane keeps, first to last: the counts a NaN hunt reads, whatever the width.
_KEPT_FIRST = ("name", "NaN", "Inf", "min", "max", "shape", "role", "dtype", "mean", "std")


def tensor_table(view: views.StepView, width: int | None = None) -> Table:
    """A step's tensors, one line each, non-finite counts in red. In ``width`` columns, the columns
    that do not fit are left out whole, least needed first (``_KEPT_FIRST``): the NaN and Inf counts
    stay, where a table squeezed by Rich cut them to "…". A long dotted name is cut in its middle
    (``views.cut_dotted``): cut at its end, a layer's weight and bias read the same."""
    rows = []
    for t in view.tensors:
        s = t.stats

        def cell(key: str, s: dict[str, float] = s) -> Text:
            value = s.get(key)
            if key in ("nan", "inf"):
                count = int(value or 0)
                return Text(str(count), style="bold red" if count else "")
            return Text(views.fmt_number(value))

        role = Text.assemble(("frozen ", "cyan"), t.role) if t.frozen else Text(t.role)  # requires_grad=False
        rows.append((role, Text(shown(t.name)), Text(t.shape), Text(t.dtype), cell("min"), cell("max"),
                     cell("mean"), cell("std"), cell("nan"), cell("inf")))
    # (a cell's padding: one column each side, none at the table's edges: two more than the width given)
    need = [max([len(name), *(row[i].cell_len for row in rows)]) + 2 for i, name in enumerate(_COLUMNS)]
    need[1] = min(need[1], 30)  # a long name is cut ("…") rather than pushing the counts out
    kept, name_width = set(range(len(_COLUMNS))), 28
    if width is not None:
        width += 2
        kept, room = set(), width
        for name in _KEPT_FIRST:
            i = _COLUMNS.index(name)
            if need[i] <= room or (name == "name" and room >= 9):  # the name shrinks to what is left
                kept.add(i)
                room -= min(need[i], room)
        over = sum(need[i] for i in kept) - width
        name_width = max(4, min(28, need[1] - 2 - max(0, over)))
    table = Table(box=None, pad_edge=False, show_edge=False, header_style="bold", expand=False,
                  row_styles=["", "on #1c1c28"], padding=(0, 1))
    order = sorted(kept)
    for i in order:
        name = _COLUMNS[i]
        table.add_column(name, justify="right" if i >= 4 else "left", no_wrap=True, overflow="ellipsis",
                         max_width=name_width if name == "name" else None)
    for row in rows:
        cells = list(row)
        if "." in cells[1].plain and cells[1].cell_len > name_width:  # a parameter's path (Rich cut its end)
            cells[1] = Text(views.cut_dotted(cells[1].plain, name_width))
        table.add_row(*(cells[i] for i in order))
    return table


_PLAIN_CODE = ANSISyntaxTheme({Keyword: Style(bold=True), Name.Decorator: Style(bold=True), String: Style(italic=True),
                               Comment: Style(dim=True)})


def highlighted(source: str, first_line: int, plain: bool = False) -> Text:
    """Python source with syntax colours and line numbers, as one Text (cheap to draw again);
    ``plain`` (NO_COLOR): keywords in bold, no colours (whose greys would read as alarms)."""
    code = Syntax(source, "python", theme=_PLAIN_CODE if plain else "ansi_dark").highlight(source.rstrip("\n"))
    out = Text(no_wrap=True, overflow="ellipsis")  # a line wider than the pane ends in "…", never looks whole
    for number, line in enumerate(code.split("\n", allow_blank=True), first_line):
        out.append(f"{number:>5} ", style="dim")
        out.append_text(line)
        out.append("\n")
    return out


class Prompt(ModalScreen[str | None]):
    """One line of input (a selector, a condition, an expression, a reference)."""

    DEFAULT_CSS = """
    Prompt { align: center middle; }
    Prompt > Vertical { width: 70; height: auto; border: round $accent; background: $panel; padding: 1; }
    """
    BINDINGS = [Binding("escape", "cancel", "cancel")]

    def __init__(self, title: str, placeholder: str = "", value: str = "") -> None:
        super().__init__()
        self.title_text, self.placeholder, self.value = title, placeholder, value

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(self.title_text)
            yield Input(value=self.value, placeholder=self.placeholder, id="prompt-input")
        yield Footer()  # this screen's keys, over the main screen's

    @on(Input.Submitted)
    def submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value)

    def action_cancel(self) -> None:
        self.dismiss(None)


class TextScreen(ModalScreen[None]):
    """A read-only page (help, alerts, the paper view, the tensor inspector)."""

    DEFAULT_CSS = """
    TextScreen { align: center middle; }
    TextScreen > VerticalScroll { width: 95%; height: 90%; border: round $accent; background: $panel; padding: 0 1; }
    """
    BINDINGS = [Binding("escape,q", "close", "close")]

    def __init__(self, body: Any, name: str) -> None:
        super().__init__(name=name)
        self.body = body

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Static(self.body, id="page")
        yield Footer()  # this screen's keys, over the main screen's

    def action_close(self) -> None:
        self.dismiss(None)


class Inspector(ModalScreen[None]):
    """The tensor inspector: histogram, a slice of values (] [ move it, o chooses where it starts),
    and a statistic across iterations (t cycles which)."""

    DEFAULT_CSS = """
    Inspector { align: center middle; }
    Inspector > VerticalScroll { width: 95%; height: 90%; border: round $accent; background: $panel; padding: 0 1; }
    """
    BINDINGS = [Binding("escape,q", "close", "close"), Binding("right_square_bracket", "slice(1)", "next slice"),
                Binding("left_square_bracket", "slice(-1)", "previous slice"), Binding("o", "offset", "offset"),
                Binding("t", "stat", "statistic")]
    STATS = ("absmax", "max", "min", "mean", "std", "norm", "nan", "inf")
    ROWS = 8
    BIG = 4_000_000  # elements: a larger tensor is read and summarised in a worker, the screen live meanwhile

    def __init__(self, step: Any, name: str, role: str) -> None:
        super().__init__(name="tensor")
        self.step, self.tensor_name, self.role = step, name, role
        self.start, self.stat, self.numel = 0, "absmax", 0
        self.sliced = True  # whether the page shows a slice of values, which ] [ and o move

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """A tensor kept as statistics only has no slice: its footer does not offer to move one."""
        return self.sliced or action not in ("slice", "offset")

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Static(id="page")
        yield Footer()  # this screen's keys, over the main screen's

    def on_mount(self) -> None:
        self.render_page()

    def render_page(self) -> None:
        record = next((r for r in self.step.records if r.name == self.tensor_name and r.role == self.role), None)
        if record is not None and record.has_payload and math.prod(record.shape) > self.BIG:
            self.query_one("#page", Static).update(Text(f"reading {self.role} {self.tensor_name} "
                                                        f"({math.prod(record.shape):,} elements) …", style="cyan"))
            self.run_worker(functools.partial(self._view, self.start, self.stat, self.per_row), thread=True,
                            exclusive=True, group="inspector")
            return
        self._show(self._view(self.start, self.stat, self.per_row, threaded=False))

    def _view(self, start: int, stat: str, per_row: int, threaded: bool = True) -> Any:
        """The tensor view (or the error that stopped it); in a worker, handed to ``_show``."""
        try:
            view: Any = views.tensor_view(self.step, self.tensor_name, self.role, start=start, rows=self.ROWS,
                                          stat=stat, per_row=per_row)
        except PdbgError as exc:
            view = exc
        if threaded:
            from textual.worker import get_current_worker

            if not get_current_worker().is_cancelled:  # a later key's worker replaced this one: its view is stale
                self.app.call_from_thread(self._show, view)
        return view

    def _show(self, view: Any) -> None:
        if not self.is_attached:  # closed while a worker read the tensor
            return
        if isinstance(view, PdbgError):  # a damaged part of the recording: say so, keep the app usable
            self.query_one("#page", Static).update(Text(f"cannot show {self.role} {self.tensor_name}: {view}\n\n"
                                                        "escape close", style="red"))
            return
        self.start, self.numel = view.start, view.size
        text = render_tensor(view, width=self.page_width)
        if self.sliced != bool(view.values):
            self.sliced = bool(view.values)
            self.refresh_bindings()
        keys = "] [ next/previous slice · o start at element · " if self.sliced else ""
        text.append(f"\n{keys}t statistic · escape close", style="dim")
        self.query_one("#page", Static).update(text)

    @property
    def page_width(self) -> int:
        return int(self.app.size.width * 0.95) - 6  # the page's border, padding and scroll bar

    @property
    def per_row(self) -> int:
        """Values a row of the slice holds: as many as the page's width takes (8 at most; 5 at 80
        columns, 2 of a complex tensor, whose values are two numbers each)."""
        page = self.page_width
        record = next((r for r in self.step.records if r.name == self.tensor_name and r.role == self.role), None)
        width = views.value_width(record.dtype if record is not None else "")
        return max(1, min(8, (page - 10) // width))  # "   index: " and the columns of a value

    def action_slice(self, delta: int) -> None:
        start = max(0, self.start + delta * self.ROWS * self.per_row)
        if delta > 0 and start >= self.numel:  # already at the last slice
            return
        self.start = start
        self.render_page()

    def action_offset(self) -> None:
        def done(value: str | None) -> None:
            if value is None or not value.strip():
                return
            if not value.strip().isdecimal():
                self.notify(f"{value.strip()!r} is not an element index: give a whole number from 0",
                            severity="error")
                return
            self.start = int(value)
            self.render_page()

        self.app.push_screen(Prompt("show values from element (flattened index)", "0"), done)

    def action_stat(self) -> None:
        self.stat = self.STATS[(self.STATS.index(self.stat) + 1) % len(self.STATS)]
        self.render_page()

    def action_close(self) -> None:
        self.dismiss(None)


class PaperScreen(ModalScreen[tuple[str, str] | None]):
    """The paper steps as a tree; choosing a node filters the timeline to its steps: it returns the
    node's filter and its path in the tree (what the panel names the filter by)."""

    DEFAULT_CSS = """
    PaperScreen { align: center middle; }
    PaperScreen > Tree { width: 90%; height: 85%; border: round $accent; background: $panel; }
    """
    BINDINGS = [Binding("escape,q", "close", "close")]

    def __init__(self, tree: views.PaperNode) -> None:
        super().__init__(name="paper")
        self.paper = tree

    def compose(self) -> ComposeResult:
        from textual.widgets import Tree

        tree: Tree[tuple[str, str]] = Tree("paper steps · calls forward/backward · time · anomalies", id="paper-tree")
        tree.root.expand()

        width = int(self.app.size.width * 0.9) - 3  # the tree's border and scroll bar

        def add(parent: Any, node: views.PaperNode, path: str = "", depth: int = 1) -> None:
            for child in node.children.values():
                where = f"{path} › {shown(child.label)}" if path else shown(child.label)
                counts = f"   {child.forward}/{child.backward} · {views.fmt_seconds(child.seconds)}"
                alerts = f" · {child.alerts} anomalies" if child.alerts else ""
                # a long label gives way (its whole is in the step pane): the counts and anomalies stay on screen
                room = max(12, width - tree.guide_depth * depth - 2 - cell_len(counts + alerts))
                name = shown(child.label) if cell_len(shown(child.label)) <= room else \
                    views.fit_cells(shown(child.label), room).rstrip()
                label = Text.assemble((name, "bold" if child.children else ""), (counts, "dim"), (alerts, "red"))
                branch = parent.add(label, data=(child.filter, where), expand=True) if child.children else \
                    parent.add_leaf(label, data=(child.filter, where))
                add(branch, child, where, depth + 1)

        add(tree.root, self.paper)
        yield tree
        yield Footer()  # this screen's keys, over the main screen's

    def on_tree_node_selected(self, event: Any) -> None:
        if event.node.data:
            self.dismiss(event.node.data)

    def action_close(self) -> None:
        self.dismiss(None)


class Actions(Provider):
    """Every action, in the command palette."""

    async def search(self, query: str) -> Hits:
        app = self.app
        assert isinstance(app, PdbgApp)
        matcher = self.matcher(query)
        for name, help_text in app.ACTION_HELP:
            score = matcher.match(f"{name} {help_text}")
            if score > 0:
                yield Hit(score, matcher.highlight(f"{help_text}"), lambda n=name: app.run_action(n), help=name)


# Control characters and bidirectional overrides: a recording's names and messages may hold terminal
# escape sequences (a shared bundle is data from elsewhere). Drawn, they would reach the terminal.
_PLAIN = Style()
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


class _PrintableOnly(LineFilter):
    """Takes control characters out of the text the app draws (a terminal would act on them; the
    layout gave them no width). Textual's own control segments pass as they are."""

    def apply(self, segments: list[Segment], background: Any) -> list[Segment]:
        return [Segment(_CONTROL.sub("", s.text), s.style, s.control)
                if s.control is None and _CONTROL.search(s.text) else s for s in segments]


class _AlarmsStandOut(LineFilter):
    """With NO_COLOR, textual draws every colour as its grey: red (a NaN, the origin, a mismatch) and
    magenta (an exception) turn into dark greys that barely show. Bold text in those colours, or text
    on them, is drawn bold and reversed instead, before the greys are made."""

    ALARM = Style(bold=True, reverse=True)

    def apply(self, segments: list[Segment], background: Any) -> list[Segment]:
        return [Segment(s.text, self._plain(s.style) + self.ALARM, s.control)
                if s.control is None and s.style is not None and self._alarm(s.style) else s for s in segments]

    @staticmethod
    def _alarm(style: Style) -> bool:
        def alarming(color: Any) -> bool:
            if color is None or color.is_default:
                return False
            r, g, b = color.get_truecolor()
            return r >= 128 and g < 0.45 * r and (b < 0.6 * r or bool(style.bold))  # red; bold magenta
        # (text only when bold: the timeline's backward arrows and highlighted code are red or magenta too)
        return (bool(style.bold) and alarming(style.color)) or alarming(style.bgcolor)

    @staticmethod
    def _plain(style: Style) -> Style:
        return Style(bold=style.bold, italic=style.italic, underline=style.underline, link=style.link)


class PdbgApp(App[None]):
    """Travel through a recording: the cursor is "now"."""

    TITLE = "PaperDebugger"
    COMMANDS = App.COMMANDS | {Actions}
    CSS = """
    #panel { height: auto; max-height: 8; border: round $primary-darken-3; padding: 0 1; overflow-y: auto; }
    #main.narrow { layout: vertical; }
    #main.narrow Timeline { width: 1fr; height: 1fr; }
    #main.narrow StepPane { width: 1fr; height: 1fr; }
    """
    WIDE = 140  # columns from which the step pane sits beside the timeline rather than below it
    # rows of a narrow screen that are not the step pane's or the panel's, at the least: header, footer and the
    # timeline's three rows in their border (5)
    BESIDE_STEP_PANE = 7
    PANEL_ROWS = 8  # the panel at its tallest (#panel's max-height)
    HEADER_ROOM = 18  # columns of the header that are not its title's: the icon's (8) and the clock's space (10)
    FOOTER_ROOM = 100  # columns that the footer's keys and the command palette's take, spaced as usual
    BINDINGS = [
        Binding("right,l", "step(1)", "next", show=False), Binding("left,h", "step(-1)", "back", show=False),
        Binding("down,j", "step(1)", show=False), Binding("up,k", "step(-1)", show=False),
        Binding("pagedown", "page(1)", show=False), Binding("pageup", "page(-1)", show=False),
        Binding("home", "edge(0)", show=False), Binding("end", "edge(1)", show=False),
        Binding("right_square_bracket", "iteration(1)", "iter▶"),
        Binding("left_square_bracket", "iteration(-1)", "◀iter", show=False),
        Binding("n", "anomaly(1)", "anomaly▶"), Binding("N", "anomaly(-1)", show=False),
        Binding("g", "origin", "origin"), Binding("colon", "goto", "go to"),
        Binding("slash", "find(0)", "find"), Binding("backslash", "find(1)", show=False),
        Binding("f", "filter", "filter", show=False), Binding("enter", "inspect", "inspect", show=False),
        Binding("a", "alerts", "alerts", show=False), Binding("p", "paper", "paper", show=False),
        Binding("r", "replay", "replay"), Binding("b", "bisect", "bisect"),
        Binding("e", "edit", "edit", show=False), Binding("s", "swap", "swap", show=False),
        Binding("x", "export", "bundle", show=False), Binding("d", "diff", "diff", show=False),
        Binding("R", "reload", "refresh", show=False), Binding("escape", "cancel", "cancel", show=False),
        Binding("v", "result", "result", show=False),
        Binding("question_mark", "help", "keys"),
        Binding("q", "quit", "quit"),
    ]
    ACTION_HELP = [
        ("step(1)", "step forward (→, l)"), ("step(-1)", "step backward (←, h)"),
        ("iteration(1)", "next iteration (])"), ("iteration(-1)", "previous iteration ([)"),
        ("anomaly(1)", "next anomaly (n)"), ("anomaly(-1)", "previous anomaly (N)"),
        ("origin", "go to the NaN origin (g)"), ("goto", "go to a step selector (:)"),
        ("find(0)", "find the next step matching a condition (/)"),
        ("find(1)", "find the previous step matching a condition (\\)"),
        ("filter", "filter the timeline (f)"), ("inspect", "inspect the selected tensor (enter)"),
        ("alerts", "alerts: origins, exceptions, broken expectations (a)"), ("paper", "the paper view (p)"),
        ("replay", "replay this step (r)"), ("bisect", "bisect: the origin and its operation (b)"),
        ("edit", "edit a tensor and rerun (e)"), ("swap", "swap the module or function and rerun (s)"),
        ("export", "export this step as a bundle (x)"), ("diff", "diff against another run (d)"),
        ("reload", "refresh a recording still being written (R)"), ("cancel", "cancel the running action (escape)"),
        ("result", "the last result in full, scrolled by keys (v)"),
        ("help", "every key (?)"), ("quit", "quit (q)"),
    ]

    def __init__(self, rec: Recording, *, path: str | None = None, start: int | None = None,
                 notice: str | None = None, script: str | None = None, use_bundled_source: bool = False) -> None:
        super().__init__()
        self._filters.append(_PrintableOnly())
        if self.no_color:
            self._filters.insert(0, _AlarmsStandOut())  # before textual's greys
        self.notice = notice  # shown in the panel at start (a --at that named no step)
        self.rec = rec
        # where replays find the steps' code: the script's path now (it moved), a bundle's own copy
        self.code_options: dict[str, Any] = {"script": script, "use_bundled_source": use_bundled_source}
        self.path = path or str(rec.path)
        self.model = views.TimelineModel(rec)
        self.start = start
        self.panel_text: Text | str = ""
        self.panel_full: Text | str = ""  # the panel's result whole (a replay's every tensor and warning)
        self._drifts: dict[int, str | None] = {}
        self._code_states: dict[tuple[Any, ...], str] = {}  # a submodule class's code now: once per class and hash
        self._paper_filter: str | None = None  # the paper view's node the filter was set from (apply_filter)

    # -- layout --------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Header(show_clock=False)
        with Horizontal(id="main"):
            # Looked up at each move rather than bound now, so a wrapper set on the app is seen too.
            yield Timeline(self.model, on_move=lambda: self.show_step(), id="timeline")  # noqa: PLW0108
            yield StepPane(id="step")
        yield Static("", id="panel")
        yield Footer(id="keys")

    def on_unmount(self) -> None:
        gc.unfreeze()

    def on_resize(self, event: Any) -> None:
        self.query_one("#main").set_class(event.size.width < self.WIDE, "narrow")
        self.query_one(StepPane).fit_below_timeline()
        self._fit_footer(event.size.width)
        self.sub_title = self._summary(event.size.width)

    def _fit_footer(self, width: int) -> None:
        """Under FOOTER_ROOM columns the footer's keys go compact and the command palette's key (ctrl+p, which
        the start's panel and ? name) leaves it: docked on the right, it was drawn over "b bisect", and
        "? keys" and "q quit" were past the edge (an 80-column footer read "^pale tte")."""
        footer = self.query_one("#keys", Footer)
        narrow = width < self.FOOTER_ROOM
        if footer.compact != narrow:
            footer.compact, footer.show_command_palette = narrow, not narrow
            footer.refresh(recompose=True)

    def on_mount(self) -> None:
        # What exists now (imports, the recording's columns) lives as long as the app: keep the
        # garbage collector from scanning it on every full collection (~0.1 s each, mid-keystroke).
        gc.freeze()
        self.query_one("#main").set_class(self.size.width < self.WIDE, "narrow")
        self._fit_footer(self.size.width)
        self.sub_title = self._summary(self.size.width)
        timeline = self.query_one(Timeline)
        timeline.focus()
        if self.start is not None:
            timeline.go_to(self.start)
        self.show_step()
        why = self.rec.ended_by
        text = Text("? every key · ctrl+p actions · g the NaN origin · r replay", style="dim")
        if why:
            text = Text.assemble((f"{self.rec.status}, ended by: {why}\n", "yellow"), text)
        verified = self._bundle_verified()
        if verified:
            text = Text.assemble(verified, "\n", text)
        if self.rec.reader.newer:  # (its warning went to the terminal just before the app took the screen)
            text = Text.assemble((self.rec.reader.newer + "\n", "yellow"), text)
        if self.notice:
            text = Text.assemble((self.notice + "\n", "red"), text)
        self.set_panel(text)
        self.panel_full = ""  # a hint, no result: v has nothing to open

    def _bundle_verified(self) -> Text | None:
        """For a bundle verified when made: its verdict, what verified it and what here differs from
        that (in yellow where something does); nothing for one made before bundles recorded what
        verified them (pdbg info says it is not recorded)."""
        from replayer.bundles import verification_note, verified_environment

        try:
            info = self.rec.bundle_info
            if info is None or verified_environment(info.get("verified")) is None:
                return None
            note = verification_note(self.rec)
        except PdbgError:  # a damaged bundle.json: the steps may still be read
            return None
        if note is None:
            return None
        return Text(note, style="yellow" if "MISMATCH" in note or "; here differs" in note else "dim")

    def _summary(self, width: int | None = None) -> str:
        """The header's line after the title: status, the mode where it keeps tensors' bytes of some steps
        only, steps, the recording's path, its rank. In ``width``
        columns (the screen's) the path gives way from its start, so the file's name stays: the header cut
        it at its end ("runs/nan_smooth_relu.za…" at 80 columns)."""
        ranks = self.rec.ranks
        rank = f" · rank {self.rec.rank.rank} of {len(ranks)}" if len(ranks) > 1 else ""
        mode = self.rec.run_info.get("mode") if self.rec.bundle_info is None else None
        kept = {"stats": "stats mode · ", "flight": "flight mode · "}.get(mode, "")  # (what r can replay)
        steps = f"{self.model.n} step{'s' if self.model.n != 1 else ''} · "
        counts, path = f"{self.rec.status} · {kept}{steps}", self.path
        if width is not None:
            room = width - self.HEADER_ROOM - cell_len(f"{self.TITLE} — {counts}{rank}")
            if kept and room < cell_len(Path(path).name) + 2:  # the mode gives way before the file's name
                counts, room = f"{self.rec.status} · {steps}", room + cell_len(kept)
            path = views.shortened_path(path, max(12, room))
        return f"{counts}{path}{rank}"

    @property
    def timeline(self) -> Timeline:
        return self.query_one(Timeline)

    @property
    def step(self) -> Any:
        index = self.timeline.step_index
        return None if index is None else self.rec.step(index)

    def show_step(self) -> None:
        if getattr(self, "_panel_transient", False):
            self.set_panel("")
        pane = self.query_one(StepPane)
        try:
            step = self.step
            if step is None:
                unrecorded = compiled_unrecorded_note(self.rec.rank.final)  # (a run compiled whole)
                pane.show_message(f"no step matches the filter {self.filter_name} (f changes it)"
                                  if self.model.n else "no steps committed yet (R refreshes)"
                                  if self.rec.status == "recording" else f"no steps: the recording is {self.rec.status}"
                                  " and holds none" + (f"\n\n{unrecorded}" if unrecorded else ""))
                pane.border_title = None
                return
            pane.show(views.step_view(step), self._drift(step), self._code_drift(step))
        except PdbgError as exc:  # a damaged part of the recording: say so, keep the app usable
            pane.show_message(Text(f"cannot show this step: {exc}", style="red"))
            return
        # The pane's border, not the header: a header title that changes would lay the screen out again.
        pane.border_title = f"step {step.index} · iteration {step.iteration}"

    def _drift(self, step: Any) -> str | None:
        """Whether the code of the step changed since recording (read from the files, never run;
        once per definition: the files are parsed, not the steps)."""
        from replayer.code import CodeLoader, drift_without_running

        key = int(step._col("definition"))
        if key not in self._drifts:
            state = drift_without_running(step.definition, self.rec.run_info, CodeLoader(self.rec.run_info).dirs)
            self._drifts[key] = f"✎ {state}" if state.startswith("changed") else None
        return self._drifts[key]

    def _code_drift(self, step: Any) -> list[str]:
        """The classes of the step's submodules whose code changed since recording (schema 1.17; read from the
        files, never run; each class's file parsed once)."""
        from replayer.code import CodeLoader, drift_without_running, submodule_entries, submodule_label

        row = int(step._col("module"))
        if row < 0 and step.phase == "backward" and step.forward is not None:
            step = self.rec.step(step.forward)  # (a backward step's module is its forward's)
            row = int(step._col("module"))
        if row < 0:
            return []
        doc = self.rec.rank.doc(row)
        out = []
        for ref, entry, paths in submodule_entries(doc, step.module_path):
            key = (ref, entry["file"], entry["source_sha256"])
            if key not in self._code_states:
                self._code_states[key] = drift_without_running({**entry, "ref": ref}, self.rec.run_info,
                                                               CodeLoader(self.rec.run_info).dirs)
            if self._code_states[key].startswith("changed"):
                out.append(f"✎ code of {submodule_label(ref, step.name, paths)} {self._code_states[key]}")
        return out

    def set_panel(self, text: Text | str, full: Text | str | None = None, *, transient: bool = False) -> None:
        """Show ``text`` in the result panel (a few lines high); ``full``: the whole result, which
        ``v`` opens in a page that keys scroll (the panel says so when there is more than it shows).
        ``transient``: an answer about where the cursor is ("no further anomaly after this step"),
        cleared when the cursor moves, when it would no longer be true."""
        self._panel_transient = transient
        # Plain strings are shown as they are: they hold what the user typed and names from the
        # recording, never markup ("[/]" in a filter crashed the app).
        text = Text(text) if isinstance(text, str) else text
        full = Text(full) if isinstance(full, str) else full
        self.panel_text, self.panel_full = text, text if full is None else full
        panel = self.query_one("#panel", Static)
        panel.update(text)
        self.call_after_refresh(self.query_one(StepPane).fit_below_timeline)  # (the panel's height may change)
        lines = str(self.panel_full).count("\n") + 1
        panel.border_subtitle = "v: all of it" if full is not None and str(full) != str(text) or lines > 6 else ""

    def action_result(self) -> None:
        if str(self.panel_full):
            self.push_screen(TextScreen(self.panel_full, "result"))

    # -- time travel ---------------------------------------------------------------------------
    def action_step(self, delta: int) -> None:
        t = self.timeline
        t.cursor = max(0, min(len(self.model.rows) - 1, t.cursor + delta))

    def action_page(self, delta: int) -> None:
        self.action_step(delta * max(1, self.timeline.size.height - 1))

    def action_edge(self, end: int) -> None:
        self.timeline.cursor = max(0, len(self.model.rows) - 1) if end else 0

    def _jump(self, index: int | None, what: str) -> None:
        if index is None:
            among = " among the steps the filter shows" if self.model.filter_text else ""
            self.set_panel(Text(f"no {what}{among}", style="yellow"), transient=True)
            return
        self.go_to_step(index)

    def go_to_step(self, index: int) -> None:
        """Put the cursor on a step. When the filter hides it, the filter is cleared first (and a
        note says so): the cursor never lands on another step than the one asked for."""
        rows = self.model.rows
        pos = int(np.searchsorted(rows, index))
        if self.model.filter_text and (pos >= len(rows) or int(rows[pos]) != index):
            self.model.apply_filter("")
            self.timeline.refresh_rows()
            self.notify(f"filter cleared: it hid step {index}")
        self.timeline.go_to(index)

    def action_iteration(self, delta: int) -> None:
        index = self.timeline.step_index
        if index is not None:
            self._jump(views.next_iteration(self.model, index, delta), "later iteration" if delta > 0 else
                       "earlier iteration")

    def action_anomaly(self, delta: int) -> None:
        index = self.timeline.step_index
        if index is None:
            return
        found = views.next_anomaly(self.model, index, delta)
        self._jump(found if found != index else None, "further anomaly " + ("after" if delta > 0 else "before")
                   + " this step")

    def action_origin(self) -> None:
        from replayer import first_nonfinite

        try:
            origin = first_nonfinite(self.rec, all_ranks=True)
        except PdbgError as exc:  # a damaged recording: say so, keep the app
            self.set_panel(Text(str(exc), style="red"))
            return
        target = origin.step or origin.entered or origin.raised_in
        self.set_panel(Text(origin.cause + self._elsewhere(origin), style="green" if origin.clean else "bold red"))
        if target is not None and origin.rank in (None, self.rec.rank.rank):
            self.go_to_step(target.index)

    def _elsewhere(self, origin: Any) -> str:
        """When the origin is on another rank than the one shown: how to open that one."""
        if origin.rank is None or origin.rank == self.rec.rank.rank:
            return ""
        return (f"\n(this view shows rank {self.rec.rank.rank}; open rank {origin.rank} with: pdbg "
                f"{shlex.quote(self.path)} --rank {origin.rank})")

    def action_goto(self) -> None:
        def done(value: str | None) -> None:
            if value:
                try:
                    self.go_to_step(self.rec.step(value).index)
                except PdbgError as exc:
                    self.set_panel(Text(str(exc), style="red"), transient=True)

        self.push_screen(Prompt("go to a step: an index or NAME[@iter=K][#CALL][:backward]", "Eq. 2@iter=5"), done)

    def action_find(self, backward: int) -> None:
        def done(value: str | None) -> None:
            if not value or not value.strip():  # (blank names no step: a selector of nothing would match every one)
                return
            index = self.timeline.step_index or 0
            try:
                found = views.find(self.model, index, value, bool(backward))
            except PdbgError as exc:
                self.set_panel(Text(str(exc), style="red"))
                return
            self._jump(found, f"step {'before' if backward else 'after'} this one matching {value!r}")
            if found is not None:
                self.set_panel(Text(f"{'◀' if backward else '▶'} {value}: step {found}", style="cyan"))

        way = "previous" if backward else "next"
        self.push_screen(Prompt(f"find the {way} step: a condition (ROLE[.NAME].STAT OP NUMBER, and/or/not), a "
                                "selector, or SELECTOR when CONDITION", "output.absmax > 1e3"), done)

    def action_filter(self) -> None:
        def done(value: str | None) -> None:
            if value is not None:
                self.apply_filter(value)

        title = "filter: text in name, label or path; phase:backward status:nonfinite iter:5"
        if self.paper_filter is not None:  # its text is a JSON list of step names: not what anyone would type
            self.push_screen(Prompt(f"{title}\n(now: the paper view's {self.paper_filter}; enter with nothing clears "
                                    "it, escape keeps it)", "phase:backward"), done)
            return
        self.push_screen(Prompt(title, value=self.model.filter_text), done)

    @property
    def paper_filter(self) -> str | None:
        """The paper view's node whose steps the filter keeps (its place in the tree), if it is one."""
        return self._paper_filter if self.model.filter_text and self._paper_filter else None

    @property
    def filter_name(self) -> str:
        """The filter as the panel and the step pane name it: as typed, or the paper view's node."""
        paper = self.paper_filter
        return f"paper view: {paper}" if paper is not None else repr(self.model.filter_text)

    def apply_filter(self, value: str, shown_as: str | None = None) -> None:
        """``shown_as``: what the panel calls the filter (the paper view's node, whose filter text is a
        JSON list of step names)."""
        current = self.timeline.step_index
        try:
            count = self.model.apply_filter(value)
        except PdbgError as exc:  # a term with a value it cannot have: the filter stays as it was
            self.set_panel(Text(str(exc), style="red"))
            return
        self._paper_filter = shown_as
        self.timeline.refresh_rows()
        if current is not None:
            self.timeline.go_to(current)
        steps = f"{count} step{'' if count == 1 else 's'}"
        self.set_panel(f"paper view: {shown_as}: {steps} (f changes the filter)" if shown_as
                       else f"filter {value!r}: {steps} (f changes it)" if value.strip()
                       else f"no filter: {steps}")
        self.show_step()

    def action_reload(self) -> None:
        index = self.timeline.step_index
        try:
            rec = Recording(self.rec.path, self.rec.rank.rank, storage_options=self.rec.storage_options)
        except PdbgError as exc:  # gone, or being rewritten: keep what is shown
            self.set_panel(Text(f"cannot refresh: {exc}", style="red"))
            return
        filter_text = self.model.filter_text
        self.rec, self.model = rec, views.TimelineModel(rec)
        if filter_text:
            self.model.apply_filter(filter_text)
        self._drifts.clear()
        self._code_states.clear()
        self.timeline.model = self.model
        self.timeline.refresh_rows()
        if index is not None:
            self.timeline.go_to(index)
        self.sub_title = self._summary(self.size.width)
        kept = f"; filter {self.filter_name}: {len(self.model.rows)} shown" if filter_text else ""
        self.set_panel(f"refreshed: {self.model.n} step{'' if self.model.n == 1 else 's'} committed "
                       f"({self.rec.status}){kept}")
        self.show_step()

    # -- pages ---------------------------------------------------------------------------------
    def action_help(self) -> None:
        text = Text("Keys\n\n", style="bold")
        for _, help_text in self.ACTION_HELP:
            text.append(f"  {help_text}\n")
        text.append("\nMoving: ↑/↓ (a row), PgUp/PgDn (a page), Home/End (the first or last step); tab moves the "
                    "focus to the step pane, where the same keys choose a tensor and enter opens the inspector; past "
                    "the last tensor (↓, or End again) they scroll on to the code. ctrl+p lists every action.",
                    style="dim")
        self.push_screen(TextScreen(text, "help"))

    def action_inspect(self) -> None:
        step = self.step
        if step is None:
            return
        tensor = self.query_one(StepPane).tensor()
        if tensor is None:
            self.set_panel("this step has no tensors")
            return
        self.push_screen(Inspector(step, tensor.name, tensor.role))

    def action_alerts(self) -> None:
        try:
            rows = views.alerts(self.rec)
        except PdbgError as exc:  # a damaged recording: say so, keep the app
            self.set_panel(Text(str(exc), style="red"))
            return
        text = Text("Alerts\n\n", style="bold")
        if not rows:
            text.append("no non-finite values, exceptions or broken expectations recorded", style="green")
        # wrapped under the message's column, not under the kind's (the page's width: the inspector's)
        room = max(20, int(self.size.width * 0.95) - 6 - 12)
        for row in rows:
            style = {"origin": "bold red", "entered": "red", "exception": "magenta",
                     "alert": "yellow"}.get(row.kind, "")
            text.append(f"  {row.kind:<9} ", style=style)
            lines = textwrap.wrap(row.text, room, break_on_hyphens=False) or [""]
            text.append("\n".join([lines[0], *(" " * 12 + line for line in lines[1:])]) + "\n")
        self.push_screen(TextScreen(text, "alerts"))

    def action_paper(self) -> None:
        def done(choice: tuple[str, str] | None) -> None:
            if choice:
                self.apply_filter(*choice)

        self.push_screen(PaperScreen(views.paper_tree(self.model)), done)

    # -- actions in workers --------------------------------------------------------------------
    def action_cancel(self) -> None:
        running = [w for w in self.workers if w.group == "action" and not w.is_finished]
        self.workers.cancel_group(self, "action")
        if running:
            self.set_panel(Text("cancelled", style="yellow"))

    def _report(self, text: Text | str, full: Text | str | None = None) -> None:
        """Show a worker's result, unless the worker was cancelled meanwhile."""
        from textual.worker import get_current_worker

        if not get_current_worker().is_cancelled:
            self.call_from_thread(self.set_panel, text, full)

    def _at_a_step(self, what: str) -> bool:
        """Whether the cursor is on a step; if not (no steps, or a filter that shows none), the
        panel says there is nothing to ``what``."""
        if self.step is not None:
            return True
        self.set_panel(Text(f"no step at the cursor to {what}" + (" (the filter shows none: f changes it)"
                                                                   if self.model.n else ""), style="yellow"))
        return False

    def action_replay(self, swap: dict[str, str] | None = None, edit: dict[str, str] | None = None) -> None:
        step = self.step
        if self._at_a_step("replay"):
            self.set_panel(Text(f"replaying step {step.index} …", style="cyan"))
            self._replay(step.index, swap, edit)

    @work(thread=True, exclusive=True, group="action")
    def _replay(self, index: int, swap: dict[str, str] | None, edit: dict[str, str] | None) -> None:
        import replayer

        try:
            result = replayer.replay(self.rec, index, swap=swap, edit=edit, **self.code_options)
        except PdbgError as exc:
            self._report(Text(f"cannot replay step {index}: {exc}", style="red"))
            return
        self._report(render_replay(result), render_replay(result, full=True))

    def action_bisect(self) -> None:
        self.set_panel(Text("bisecting …", style="cyan"))
        self._bisect()

    @work(thread=True, exclusive=True, group="action")
    def _bisect(self) -> None:
        import replayer

        try:
            origin = replayer.first_nonfinite(self.rec, all_ranks=True)
        except PdbgError as exc:  # a damaged recording: say so, keep the app
            self._report(Text(str(exc), style="red"))
            return
        text = Text(origin.cause + self._elsewhere(origin), style="green" if origin.clean else "bold red")
        if origin.rank not in (None, self.rec.rank.rank):
            self._report(text)
            return
        if origin.step is not None:
            try:  # (as pdbg bisect --ops: what the operation's replay did not reproduce is said too)
                from replayer.bisect import find_op

                find_op(origin, origin.step, **self.code_options)
                if origin.op is not None:
                    text.append(f"\noperation: {origin.op.where()}", style="yellow")
                if origin.op_note:
                    text.append(f"\n{origin.op_note}", style="yellow" if origin.op is not None else "dim")
                if origin.source_op is not None and origin.source is not None:
                    text.append(f"\n{origin.source_what}: {origin.source_op.where()} (step {origin.source.index})",
                                style="yellow")
            except PdbgError as exc:
                text.append(f"\noperation-level bisection needs a replay: {exc}", style="dim")
        self._report(text)
        target = origin.step or origin.entered
        if target is not None:
            self.call_from_thread(self.go_to_step, target.index)

    def _replayable(self, what: str) -> bool:
        """Whether the step at the cursor kept the bytes a rerun needs; if not, the panel says so before a
        prompt asks for an edit or a swap that could not be tried."""
        why = views.statistics_only(self.step)
        if why is None:
            return True
        self.set_panel(Text(f"cannot {what} step {self.step.index} and rerun: it kept statistics only, no tensor "
                            f"bytes{f' ({why})' if why else ''}", style="red"))
        return False

    def action_edit(self) -> None:
        if not self._at_a_step("edit") or not self._replayable("edit"):
            return

        def done(value: str | None) -> None:
            pair = split_pair(value, "--edit", self.rec) if value else None  # (parted as pdbg replay --edit)
            if pair is not None:
                self.action_replay(edit={pair[0]: pair[1]})
            elif value:
                self.set_panel(Text("write TENSOR=EXPR, e.g. args.0=x.clamp(-50, 50)", style="red"))

        self.push_screen(Prompt("edit a tensor and rerun: TENSOR=EXPR (x, torch, math)", "args.0=x.clamp(-50, 50)"),
                         done)

    def action_swap(self) -> None:
        step = self.step
        if not self._at_a_step("swap") or not self._replayable("swap in"):
            return

        def done(value: str | None) -> None:
            if value and step is not None:
                pair = split_pair(value, "--swap")  # (at the last '=', as pdbg replay --swap: a KEY may hold one)
                self.action_replay(swap={pair[0]: pair[1]} if pair is not None else {".": value.strip()}
                                   if step.module_path or step._doc("module") else {step.name: value.strip()})

        self.push_screen(Prompt("swap and rerun: [KEY=]pkg.module:Name (KEY: a module path or step name)",
                                "mypkg.stable:smooth_relu"), done)

    def action_export(self) -> None:
        step = self.step
        if not self._at_a_step("export"):
            return

        def done(value: str | None) -> None:
            if value and step is not None:
                if Path(value).exists():
                    self.set_panel(Text(f"{value} already exists: give another path, or delete it first",
                                        style="red"))
                    return
                self._export(step.index, value)

        self.push_screen(Prompt("export this step as a bundle to", value=f"step{step.index if step else 0}.pdbg"),
                         done)

    @work(thread=True, exclusive=True, group="action")
    def _export(self, index: int, path: str) -> None:
        import replayer

        try:
            info = replayer.bundle(self.rec, index, Path(path), verify=True,
                                   script=self.code_options["script"] or False)
        except PdbgError as exc:
            self._report(Text(f"no bundle: {exc}", style="red"))
            return
        except OSError as exc:  # a disk that filled while it was written: the session stays
            self._report(Text(f"no bundle: cannot write {path} ({exc.strerror or exc})", style="red"))
            return
        verdict = (f"not verified: it cannot be replayed here ({info.not_verified})" if info.not_verified else
                   "not verified: the step returned no tensor" if info.verified is None else
                   f"verified: replays, a {info.verdict}" if info.by_statistics else
                   "verified: replays bit for bit" if info.verified else "MISMATCH when replayed from the bundle")
        if info.verified is not None and info.verified_with is not None:  # (what a receiver compares theirs with)
            from replayer.bundles import environment_text

            verdict += f", with {environment_text(info.verified_with, self.rec.run_info)}"
        steps = f"{info.steps} step{'s' if info.steps != 1 else ''}"
        self._report(Text(f"wrote {info.path} ({info.bytes} bytes, {steps}); {verdict}",
                          style="green" if info.verified else "yellow" if info.verified is None else "red"))

    def action_diff(self) -> None:
        def done(value: str | None) -> None:
            if value:
                self.set_panel(Text(f"comparing with {value} …", style="cyan"))
                self._diff(value)

        self.push_screen(Prompt("diff against another recording of the same model", "other.zarr"), done)

    @work(thread=True, exclusive=True, group="action")
    def _diff(self, other: str) -> None:
        import replayer

        try:
            div = replayer.first_divergence(self.rec, replayer.open(other))
        except PdbgError as exc:
            self._report(Text(str(exc), style="red"))
            return
        apart = div.step or div.first_difference  # the root cause, else where the results first differ
        self._report(Text(("root cause: " if div.step else "") + div.cause, style="yellow" if apart else "green"))
        if apart is not None:
            self.call_from_thread(self.go_to_step, apart.index)


def render_replay(result: Any, full: bool = False) -> Text:
    """A replay's verdict and its first tensors, inner steps and warnings; ``full``: all of them."""
    by_statistics = ", ".join(result.by_statistics[:3])  # (a sparse result without its parts: not bit for bit)
    unseen = f"; not compared, not recorded as data: {', '.join(result.not_compared)}" if result.not_compared else ""
    unseen += f"; not compared: {result.unseen_text}" if result.unseen_writes else ""
    verdict = ((f"nothing compared: the output was not recorded as data: {', '.join(result.not_compared)}"
                if result.not_compared else "nothing compared", "bold yellow") if not result.compared
               else ("no change in what was compared" + unseen if unseen else
                     "no change: the intervention left every output as recorded", "bold yellow")
               if result.match and result.intervention else ("bitwise match of what was compared" + unseen,
                                                             "bold yellow") if result.match and unseen
               else (f"match, by statistics only for {by_statistics}", "bold green")
               if result.match and by_statistics else ("bitwise match", "bold green") if result.match
               else ("MISMATCH, as the intervention makes it", "bold yellow") if result.intervention
               else ("MISMATCH", "bold red"))
    text = Text.assemble(f"replay of step {result.step.index}{_intervention_text(result.intervention)}: ", verdict)
    few = None if full else 4
    for d in result.outputs[:few]:
        rec, rep = d.recorded, d.replayed
        same = d.match and not d.by_statistics  # (by statistics: the reason says what they leave out)
        text.append(f"\n  {d.name}: " + ("equal" if same else d.summary().split(": ", 1)[-1]),
                    style="green" if d.match else "red")
        if rep and not d.match:
            text.append(f"   recorded nan {rec.get('nan')} inf {rec.get('inf')} → replayed nan {rep.get('nan')} "
                        f"inf {rep.get('inf')}", style="dim")
    changed = [s for s in result.inner if not s.match]
    extra = result.unrecorded_inner
    if changed or extra:
        said = [f"step {s.step.index} {s.step.name} {s.change}" for s in changed[:few]]
        text.append("\n  inner: " + "; ".join(said + ([extra.text] if extra else [])), style="yellow")
    for w in result.warnings[:None if full else 2]:
        text.append(f"\n  {w}", style="yellow")
    if full and result.environment_differences:
        text.append("\n  environment differs from the recording: " + "; ".join(result.environment_differences),
                    style="dim")
    return text


def _nonfinite_lines(line: str, width: int | None) -> str:
    """The inspector's NaN/Inf line, in ``width`` columns: where it does not fit, broken after the counts and, if
    still too long, before the key's hint, never inside the first one's index (wrapped as words, "[1, 14, 9," stayed
    on one line and "0]" went to the next)."""
    from rich.cells import cell_len

    if width is None or cell_len(line) <= width:
        return line
    counts, _, first = line.partition("; ")
    where, hint, rest = first.partition(" (")
    parts = [f"{counts};"] + ([first] if cell_len(first) <= width or not hint else [where, f"({rest}"])
    return "\n".join(p.replace(", ", ",\u00a0") if p.startswith("the first") else p for p in parts)


def _intervention_text(intervention: dict[str, Any] | None) -> str:
    """What a what-if replay changed, as the panel's first line names it (" with edit args.0=x.clamp(-50, 50)"),
    so that the results of several tries are told apart; "" for a plain replay."""
    if not intervention:
        return ""
    done = [f"swap {k}={v}" if k != "." else f"swap {v}" for k, v in (intervention.get("swap") or {}).items()]
    done += [f"edit {k}={v}" for k, v in (intervention.get("edit") or {}).items()]
    return f" with {', '.join(done)}" if done else ""


def render_tensor(view: views.TensorView, width: int | None = None) -> Text:
    """The inspector's page; ``width``: the page's, in which the sparkline's legend goes on a line of its
    own where it would not fit after the sparkline (wrapped, its "✗" stayed behind, its meaning below)."""
    text = Text(view.title + "\n", style="bold")
    if view.statistics:  # as recorded (of |z| for a complex tensor), wrapped between items, never inside one
        label, line = "statistics of |z|: " if "|z|" in view.histogram_of else \
            "statistics: ", ""
        for item in view.statistics:
            if line and width is not None and cell_len(label + line + "  " + item) > width:
                text.append(label + line + "\n", style="dim")
                label, line = " " * len(label), ""
            line = f"{line}  {item}" if line else item
        text.append(label + line + "\n", style="dim")
    text.append("\n")
    if view.nonfinite:
        text.append(_nonfinite_lines(view.nonfinite, width) + "\n\n", style="bold red")
    if view.histogram:
        top = max(view.histogram) or 1
        lo, hi = (views.fmt_number(e) for e in view.edges)
        text.append(f"histogram of {view.histogram_of}, {lo} … {hi}\n", style="dim")
        for level in range(6, 0, -1):
            line = "".join("█" if c / top * 6 >= level else ("▄" if c / top * 6 >= level - 0.5 else " ")
                           for c in view.histogram)
            text.append("  " + line + "\n", style="cyan")
    if view.note:
        text.append(view.note + "\n", style="yellow")
    text.append(f"\n{view.slice_text}\n", style="dim")
    for row in view.values:
        text.append(row + "\n")
    if view.series:
        values = [v for _, v in view.series]
        first, last = view.series[0][0], view.series[-1][0]
        label = (f"{view.series_stat} across iterations {first}…{last} (this one underlined): " if len(values) > 1
                 else f"{view.series_stat} in iteration {first}, the only one with this call: ")
        text.append("\n" + label, style="dim")
        lo, hi = view.expected if view.expected else (-math.inf, math.inf)
        marks = view.series_marks or [""] * len(values)
        drawn = views.sparkline(values, marks)
        for i, (char, value, mark) in enumerate(zip(drawn, values, marks)):  # outside the expected range: red
            style = "dim" if mark in (views.EMPTY, views.UNKNOWN) else "green" if not mark and lo <= value <= hi \
                else "bold red"
            text.append(char, style=f"{style} underline reverse" if i == view.series_at else style)
        marked = [m for m in views.MARKS if m in drawn]
        if marked:  # (a NaN absmax is no elements as often as NaN: the marks say which)
            legend = ", ".join(f"{m} {views.MARKS[m]}" for m in marked)
            fits = width is None or cell_len(label) + cell_len(drawn) + 3 + cell_len(legend) <= width
            text.append(("   " if fits else "\n  ") + legend, style="dim")
        text.append("\n")
        if view.expected:
            broken = sum(1 for v, m in zip(values, marks) if m == views.NONFINITE or (not m and not lo <= v <= hi))
            bounds = f"[{views.fmt_number(lo)}, {views.fmt_number(hi)}]"
            text.append(f"the watch's range puts {view.series_stat} in {bounds}: "
                        f"{broken} of these {len(values)} iterations outside\n",
                        style="red" if broken else "green")
    return text


class ErrorApp(App[None]):
    """A recording that cannot be opened: its one-line reason on a screen of its own."""

    BINDINGS = [Binding("q,escape,enter", "quit", "quit")]
    CSS = "Screen { align: center middle; } #error { width: 80%; border: round red; padding: 1 2; }"

    def __init__(self, path: str, message: str) -> None:
        super().__init__()
        self._filters.append(_PrintableOnly())
        self.path, self.message = path, message

    def compose(self) -> ComposeResult:
        yield Static(Text.assemble(("cannot open ", "bold"), (self.path, "bold"), "\n\n", (self.message, "red"),
                                   "\n\n", ("q to quit", "dim")), id="error")


def open_app(path: str, start: str | None = None, rank: int = 0, *, script: str | None = None,
             use_bundled_source: bool = False) -> App[None]:
    """The app for a path (``rank``: whose steps, in a run of several processes): the TUI, or the
    error screen when the recording cannot be read. ``script``, ``use_bundled_source``: where its
    replays find the steps' code, as ``replayer.replay``'s."""
    try:
        rec = Recording(path, rank)
    except PdbgError as exc:
        return ErrorApp(path, str(exc))
    code = {"script": script, "use_bundled_source": use_bundled_source}
    try:
        index = rec.step(start).index if start else None
    except PdbgError as exc:  # the recording is fine: open it, and say why the cursor is not there
        return PdbgApp(rec, path=path, notice=f"--at {start}: {exc}", **code)
    return PdbgApp(rec, path=path, start=index, **code)


def run_app(path: str, start: str | None = None, rank: int = 0, **code: Any) -> int:
    """Open the TUI on a recording (``start``: a step to put the cursor on); exit code 2 when the
    recording could not be read."""
    app = open_app(path, start, rank, **code)
    app.run()
    return 2 if isinstance(app, ErrorApp) else 0

