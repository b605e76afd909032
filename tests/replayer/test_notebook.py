"""Notebook reprs: what Jupyter shows for a recording, a step, a step table, a replay, an origin, a
divergence and a bundle; everything from the recording escaped; cheap on big recordings; and the
replayer usable from a notebook kernel (no TUI imported, a running asyncio loop).

Set PDBG_NOTEBOOK_REPRS to a directory to keep each rendered repr there as an HTML page (shown on a
light and on a dark background, as in Jupyter's two themes)."""

from __future__ import annotations

import asyncio
import dataclasses
import html as html_mod
import linecache
import os
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

import recorder
import replayer
from recorder.store.reader import RankReader
from replayer.bisect import Origin
from tests.cli import pdbg, python
from tests.replayer import nanmodels

EVIL = "<script>alert('x')</script>"
BAD_CELL = "background: rgba(220, 38, 38, 0.28)"  # notebook._BAD: a highlighted non-finite count


@recorder.paper_step("Eq. <script>1</script>", name="evil<script>alert(1)</script>",
                     description="<b>not bold</b> & <i>not italic</i>")
def evil(x: torch.Tensor, **extra: torch.Tensor) -> torch.Tensor:
    if float(x.sum()) > 100:
        raise ValueError(EVIL)
    return x * 2


@recorder.paper_step("Eq. 9", description="fifteen layers: more tensors than a step summary lists")
class Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(2, 2) for _ in range(15)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


@recorder.paper_step("Eq. 10", description="a learning-rate schedule: an int in, a float out, no tensors")
def schedule(it: int, base: float = 0.1) -> float:
    return base / (1 + it)


def render(name: str, obj: Any) -> str:
    """``obj``'s notebook HTML (kept as a page under $PDBG_NOTEBOOK_REPRS when that is set)."""
    out = obj._repr_html_()
    tags = re.findall(r"<[^>]*>", out)
    opening = [t for t in tags if not t.startswith("</")]
    assert isinstance(out, str) and out.startswith("<div") and tags  # self-contained: styled text only
    assert all(re.fullmatch(r'<(div|span|code|table|thead|tbody|tr|th|td|ul|li)( style="[^"<>]*")?>', t)
               for t in opening), set(opening)
    assert "url(" not in out and "@import" not in out
    keep = os.environ.get("PDBG_NOTEBOOK_REPRS")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        page = ('<!doctype html><html><head><meta charset="utf-8"></head><body style="margin: 0; font-family: '
                f'sans-serif"><div style="padding: 10px">{out}</div><div style="padding: 10px; background: '
                f'#111111; color: #d4d4d4">{out}</div></body></html>')
        (Path(keep) / f"{name}.html").write_text(page, encoding="utf-8")
    return out


def text(html: str) -> str:
    """The HTML's text: tags dropped, entities decoded."""
    return html_mod.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html)))


@pytest.fixture(scope="module")
def overflow(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Scaled(4) at scales 1 then 1000: exp overflows in smooth_relu in iteration 1."""
    path = tmp_path_factory.mktemp("overflow") / "run.zarr"
    torch.manual_seed(0)
    nanmodels.record_scales(path, nanmodels.Scaled(4), (1.0, 1000.0))
    return path


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A recording whose path, step name, label, description, tensor name and exception hold markup."""
    path = tmp_path_factory.mktemp("hostile") / "run<b>.zarr"
    with recorder.record(path):
        evil(torch.ones(2), **{"<img src=x onerror=alert(1)>": torch.zeros(1)})
        with pytest.raises(ValueError):
            evil(torch.full((2,), 100.0))
    return path


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """22 forward calls of a step with 32 tensors each."""
    path = tmp_path_factory.mktemp("wide") / "run.zarr"
    model = Wide()
    with torch.no_grad(), recorder.record(path, model=model, mode="stats") as run:
        for _ in range(22):
            model(torch.randn(1, 2))
            run.next_iteration()
    return path


class TestRecording:
    def test_summary(self, overflow: Path) -> None:
        """Path, status, steps, iterations, mode, when, the hint; the origin once it was looked for."""
        rec = replayer.open(overflow)
        out = text(render("recording", rec))
        for expected in (str(overflow), "complete", "steps 8", "iterations 2 (0–1)", "mode full", "recorded 20",
                         "torch " + torch.__version__, "rec.steps", "replayer.first_nonfinite(rec)",
                         "not looked for yet"):
            assert expected in out, expected
        origin = replayer.first_nonfinite(rec)
        assert origin.step is not None and f"first non-finite {origin.step.selector}" in text(rec._repr_html_())
        assert "not looked for yet" not in rec._repr_html_()

    def test_a_crashed_run_names_its_exception(self, tmp_path: Path) -> None:
        """A run that died shows status crashed and the exception that ended it, escaped."""
        with pytest.raises(RuntimeError), recorder.record(tmp_path / "run.zarr"):
            nanmodels.smooth_relu(torch.ones(2))
            raise RuntimeError(EVIL)
        out = render("recording_crashed", replayer.open(tmp_path / "run.zarr"))
        assert "crashed" in out and "run ended with" in out and EVIL not in out
        assert "builtins:RuntimeError: &lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in out

    def test_a_summary_reads_no_payload_and_no_whole_column(self, overflow: Path, monkeypatch: Any) -> None:
        """The recording, its step table and a step render from metadata, a few rows and the step's
        tensor index: no payload, and (but for the step's own records) nothing of the tensor table."""
        asked: list[tuple[str, Any]] = []  # what the summaries ask the reader for: (column, rows or "whole")
        inside = [0]
        rows, column = RankReader.rows, RankReader.column

        def counted_rows(self: RankReader, path: str, start: int, stop: int) -> Any:
            asked.append((path, stop - start))
            inside[0] += 1  # the reader may read a tiny column whole instead: its choice, not the caller's
            try:
                return rows(self, path, start, stop)
            finally:
                inside[0] -= 1

        def counted_column(self: RankReader, path: str) -> Any:
            if not inside[0]:
                asked.append((path, "whole"))
            return column(self, path)

        monkeypatch.setattr(RankReader, "rows", counted_rows)
        monkeypatch.setattr(RankReader, "column", counted_column)
        monkeypatch.setattr(RankReader, "tensor", lambda self, r: pytest.fail("a payload was read"))
        monkeypatch.setattr(RankReader, "payload_units", lambda self, *a, **k: pytest.fail("a payload was read"))
        rec = replayer.open(overflow)
        backward = rec.steps.filter(phase="backward")  # filtering reads columns; showing the result must not
        asked.clear()
        for obj in (rec, rec.steps, backward):
            obj._repr_html_()
        assert not [a for a in asked if a[1] == "whole" and not a[0].startswith("docs/")], asked
        assert not [a for a in asked if not a[0].startswith(("steps/", "docs/"))], asked  # no tensor index
        assert sum(n for p, n in asked if p == "steps/iteration") <= 2 + 8 + 4  # two rows, then one per step shown
        asked.clear()
        step = rec.step(5)
        step._repr_html_()
        assert not [a for a in asked if a[1] == "whole" and not a[0].startswith("docs/")], asked
        assert {n for p, n in asked if p.startswith("tensors/")} == {len(step.records)}  # its own records only

    def test_a_bundle_and_its_recording(self, overflow: Path, tmp_path: Path) -> None:
        """A BundleInfo shows its path, size, steps, main step and verification; the bundle opened
        again shows it is one."""
        rec = replayer.open(overflow)
        origin = replayer.first_nonfinite(rec)
        info = replayer.bundle(rec, origin.step, tmp_path / "failure.pdbg", verify=True, script=True)
        out = text(render("bundle", info))
        assert "verified: bitwise match" in out and f"{info.bytes:,} bytes" in out
        assert f"main step {info.main_step}" in out
        assert "repro.py" in out and "replayer.open(" in out and "verified: bitwise match" in repr(info)
        opened = text(replayer.open(info.path)._repr_html_())
        assert f"bundle main step {info.main_step}" in opened and "failure.pdbg" in opened


class TestStep:
    def test_summary(self, overflow: Path) -> None:
        """Selector, paper reference, phase, iteration, call, module path, status, timing, and the
        tensors with their statistics; the Inf count highlighted."""
        rec = replayer.open(overflow)
        step = rec.step("smooth_relu@iter=1")
        html = render("step", step)
        out = text(html)
        for expected in ("Step 5 smooth_relu@iter=1#0 nonfinite", "paper Eq. 2", "SmoothReLU(x) =",
                         "phase forward", "iteration 1", "call 0", "module path (the outermost module",
                         " ms", "inside step 4", "nanmodels.py:", "input args.0 float32 3×4", "output output float32"):
            assert expected in out, expected
        inf = next(r for r in step.records if r.name == "output").stats["inf"]
        assert inf > 0 and f'<span style="{BAD_CELL}' in html and f">{int(inf)}</span>" in html
        assert "rec.step(5).tensor('args.0')" in out and "replayer.replay(rec, 5)" in out

    def test_selectors_name_the_step(self, overflow: Path) -> None:
        """Every step's selector, as the summaries print it, selects that very step."""
        rec = replayer.open(overflow)
        assert [rec.step(s.selector).index for s in rec.steps] == list(range(len(rec)))
        assert rec.step(1).selector == "smooth_relu@iter=0#0" and rec.step(2).selector == "Scaled@iter=0#0:backward"

    def test_long_tensor_lists_are_cut(self, wide: Path) -> None:
        """A step with more tensors than shown ends with how many more, stats-only tensors say so."""
        step = replayer.open(wide).step(0)
        out = render("step_wide", step)
        assert len(step.records) == 32 and "... 8 more tensors" in out
        assert out.count("layers.") == 24 - 2  # the input and the output come first
        assert ">stats</span>" in out

    def test_statistics_only_step_points_at_why(self, wide: Path) -> None:
        """A stats-mode step's summary goes on with why it has statistics only, not with tensor() and
        replay(), which would only be refused for it."""
        rec = replayer.open(wide)
        out = text(render("step_stats", rec.step(0)))
        assert "go on: rec.step(0).why_statistics_only('args.0')" in out, out
        assert ".tensor(" not in out and "replayer.replay(" not in out
        assert rec.step(0).why_statistics_only("args.0").startswith("the run was recorded in stats mode")

    def test_step_without_tensors(self, tmp_path: Path) -> None:
        """A step given and returning no tensor says so, with what it had instead, and no empty table."""
        with recorder.record(tmp_path / "run.zarr", mode="full"):
            schedule(3)
        step = replayer.open(tmp_path / "run.zarr").step(0)
        out = text(render("step_no_tensors", step))
        assert "not tensors args.0 (an int), output (a float) no tensors go on: replayer.replay(rec, 0)" in out, out
        assert "dtype" not in out and ".tensor(" not in out


class TestStepTable:
    def test_first_rows_and_the_rest_counted(self, wide: Path, overflow: Path) -> None:
        """The first 20 steps, one row each, then '... N more steps'; a filter's result likewise."""
        out = render("steps", replayer.open(wide).steps)
        assert out.count("<tr") == 21 and "... 2 more steps" in out and "22 steps" in out
        assert "Eq. 9" in out and "table.filter(" in out
        bad = replayer.open(overflow).steps.filter(status="nonfinite")
        out = text(bad._repr_html_())
        assert f"{len(bad)} steps" in out and "more steps" not in out and "nonfinite" in out


class TestReplay:
    def test_a_match(self, overflow: Path) -> None:
        """A bitwise match: the badge, each output equal with zero differences."""
        rec = replayer.open(overflow)
        res = replayer.replay(rec, "smooth_relu@iter=1")
        out = text(render("replay_match", res))
        assert res.match and "Replay of step 5 smooth_relu@iter=1#0 bitwise match" in out
        assert "output output equal 0 0 0 0 0 / 5 0 / 5" in out  # name, role, bits, differing, abs, rel, ULP, Inf

    def test_a_fix_that_changes_the_result(self, overflow: Path) -> None:
        """An edit that removes the overflow: mismatch, recorded Inf highlighted, replayed 0 / 0, and the
        first divergent inner step with what became of it; warnings and differences listed."""
        rec = replayer.open(overflow)
        res = replayer.replay(rec, "Scaled@iter=1", edit={"smooth_relu#0/args.0": "x.clamp(-50, 50)"})
        html = render("replay_fix", res)
        out = text(html)
        assert not res.match and "mismatch" in out and "differ" in out and "max ULP" in out
        assert "first divergent inner step smooth_relu@iter=1#0" in out and "became finite" in out
        assert "0 / 0" in out and BAD_CELL in html and "intervention" in out
        same = text(replayer.replay(rec, "Scaled@iter=1", settings={"deterministic": True})._repr_html_())
        assert "no change: the intervention left every output as recorded" in same and "bitwise match" not in same
        noted = dataclasses.replace(res, warnings=["code of smooth_relu changed"],
                                    environment_differences=[f"torch: {EVIL}"])
        out = noted._repr_html_()
        assert "warnings" in out and "code of smooth_relu changed" in out and "environment differences" in out
        assert "&lt;script&gt;" in out and EVIL not in out
        assert "res.diffs[&#x27;output&#x27;]" in out  # where to look first: the differing record

    def test_the_hint_names_a_record_the_result_has(self, overflow: Path) -> None:
        """A backward step's result has no "output": the hint names its first record (it named
        res.diffs["output"], a KeyError)."""
        rec = replayer.open(overflow)
        res = replayer.replay(rec, "Scaled@iter=0:backward")
        first = next(iter(res.diffs))
        assert first != "output" and f"res.diffs[&#x27;{first}&#x27;]" in res._repr_html_()


class TestBisect:
    def test_origin(self, overflow: Path) -> None:
        """The origin step, the cause sentence, the operation and its line, and the spread."""
        rec = replayer.open(overflow)
        origin = replayer.first_nonfinite(rec, ops=True)
        out = text(render("origin", origin))
        assert "First non-finite value: origin nonfinite" in out and "smooth_relu@iter=1#0" in out
        assert "from finite inputs" in out and "operation aten::exp" in out and "torch.exp(x + beta)" in out
        assert "nanmodels.py:" in out and "spread to" in out and "replayer.bundle(rec, 5" in out
        assert "aten::exp" in repr(origin) and repr(origin).startswith("<Origin: step 5")
        plain = text(replayer.first_nonfinite(rec)._repr_html_())
        assert "ops=True" in plain  # how to get the operation, when it was not asked for
        unfound = dataclasses.replace(origin, op=None, op_note="no single operation inside the step did it")
        out = text(unfound._repr_html_())  # asked for and not found: why, not how to ask for it
        assert "operation no single operation inside the step did it" in out and "ops=True" not in out
        assert "no single operation inside the step did it" in repr(unfound)

    def test_other_ranks_and_nothing_found(self, overflow: Path, hostile: Path) -> None:
        """What other ranks saw is listed; a clean recording says no non-finite value was found."""
        rec = replayer.open(overflow)
        found = replayer.first_nonfinite(rec)
        with_ranks = dataclasses.replace(found, others={1: Origin(None, "collective all_reduce returned NaN",
                                                                  entered=rec.step(0))})
        out = text(with_ranks._repr_html_())
        assert "other ranks" in out and "rank 1: collective all_reduce returned NaN" in out and "rank 0" in out
        none = replayer.first_nonfinite(replayer.open(hostile))
        assert "No non-finite value found" in text(render("origin_none", none))

    def test_divergence(self, tmp_path: Path) -> None:
        """The root cause in run A, the same step in run B, the cause, the steps that followed."""
        runs = []
        for seed in (0, 1):
            torch.manual_seed(seed)
            model = nanmodels.Stack(4)
            torch.manual_seed(5)
            nanmodels.record_scales(tmp_path / f"{seed}.zarr", model, (1.0,))
            runs.append(replayer.open(tmp_path / f"{seed}.zarr"))
        div = replayer.first_divergence(*runs)
        out = text(render("divergence", div))
        assert div.step is not None and "The runs part mismatch" in out and div.step.selector in out
        assert "same step in run B" in out and "fc.weight" in out and "steps compared" in out
        assert repr(div) == f"<Divergence: {div.cause}>"
        same = text(replayer.first_divergence(runs[0], runs[0])._repr_html_())
        assert "No divergence" in same and "no divergence: the" in same and "div.step" not in same
        torch.manual_seed(0)
        model = nanmodels.Stack(4)
        torch.manual_seed(6)  # other inputs, the same weights: no root cause, the hint names the first difference
        nanmodels.record_scales(tmp_path / "data.zarr", model, (1.0,))
        data = text(replayer.first_divergence(runs[0], replayer.open(tmp_path / "data.zarr"))._repr_html_())
        assert "with no root cause recorded" in data and "replayer.replay(rec_a, div.first_difference)" in data
        assert "div.step" not in data


class TestEscaping:
    def test_everything_from_the_recording_is_escaped(self, hostile: Path) -> None:
        """Markup in a path, step name, label, description, tensor name and exception message comes
        out as text, never as markup."""
        rec = replayer.open(hostile)
        bad = rec.step(1)
        assert bad.status == "exception"
        res = replayer.replay(rec, 1)
        assert res.exception is not None and "<script>" in res.exception
        shown = {"recording_hostile": rec, "step_hostile": bad, "steps_hostile": rec.steps,
                 "replay_hostile": res, "first_step_hostile": rec.step(0)}
        for name, obj in shown.items():
            out = render(name, obj)
            assert "<script" not in out and "<b>" not in out and "<img" not in out and "<i>" not in out, name
            assert "&lt;script&gt;" in out or "&lt;b&gt;" in out, name
        assert "ValueError: &lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in shown["step_hostile"]._repr_html_()
        assert "kwargs.&lt;img src=x onerror=alert(1)&gt;" in rec.step(0)._repr_html_()
        assert "&lt;b&gt;not bold&lt;/b&gt; &amp; &lt;i&gt;" in rec.step(0)._repr_html_()


class TestNotebookKernel:
    def test_the_replayer_imports_no_tui(self, overflow: Path, tmp_path: Path) -> None:
        """Opening, replaying, bisecting and rendering every repr in a fresh process never imports textual."""
        script = tmp_path / "nb.py"
        script.write_text(textwrap.dedent(f"""
            import sys
            import replayer
            rec = replayer.open({str(overflow)!r})
            res = replayer.replay(rec, "smooth_relu@iter=1")
            origin = replayer.first_nonfinite(rec)
            for obj in (rec, rec.steps, rec.step(0), res, origin):
                obj._repr_html_()
            assert res.match and origin.step is not None
            print(sorted(m for m in sys.modules if m.split(".")[0] in ("textual", "tui", "rich")))
        """))
        done = python(str(script), cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "[]"

    def test_the_synchronous_api_inside_a_running_event_loop(self, overflow: Path) -> None:
        """As in a Jupyter cell (the kernel runs an asyncio loop): open, replay, bisect and render work."""
        async def cell() -> tuple[Any, ...]:
            asyncio.get_running_loop()  # there is one
            rec = replayer.open(overflow)
            res = replayer.replay(rec, "smooth_relu@iter=1")
            origin = replayer.first_nonfinite(rec)
            return res, origin, rec._repr_html_(), res._repr_html_(), origin._repr_html_()

        res, origin, *pages = asyncio.run(cell())
        assert res.match and origin.step is not None and origin.step.name == "smooth_relu"
        assert all(p.startswith("<div") and "smooth_relu@iter=1#0" in p for p in pages)


def test_a_recording_opened_while_this_process_records_it_holds_every_step(tmp_path: Path) -> None:
    """A notebook's next cell opens the recording its training cell left open (`recorder.record(...)` as a
    statement, "Run All"): it showed the steps of the writer's last commit only, none of a short training's,
    and first_nonfinite found no NaN. Opening it commits what was recorded so far."""
    torch.manual_seed(0)
    model = nanmodels.Scaled(4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = recorder.record(tmp_path / "run.zarr", model=model, optimizer=opt, flush_interval=3600)
    try:
        for scale in (1.0, 1000.0):
            model(torch.randn(2, 4), scale).sum().backward()
            opt.step()
        rec = replayer.open(tmp_path / "run.zarr")
        assert rec.status == "recording" and len(rec) == run.session.next_index > 0
        assert replayer.first_nonfinite(rec).step.name == "smooth_relu"
    finally:
        run.close()


CELLS = [
    "import torch\nimport recorder\n",
    textwrap.dedent('''
        @recorder.paper_step("Eq. 9", description="the log of a cell")
        def cell_log(x):
            return torch.log(x)


        @recorder.paper_step("Eq. 10", description="a module of a cell")
        class CellBlock(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(3, 3)

            def forward(self, x):
                return cell_log(self.lin(x).exp())
    '''),
    "import dataclasses\n\n\n@dataclasses.dataclass\nclass Config:\n    scale: float = 2.0\n",
    "%matplotlib inline\nbroken = (\n",  # a cell that never parsed
    "open('trained.txt', 'w').write('the training cell ran')\n",
]


@pytest.fixture
def notebook_session(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """This process as a Jupyter kernel: ``__main__`` without a file, cells compiled under
    IPython's file names (their lines in linecache), IPython's input history in ``In``."""
    main = type(os)("__main__")
    main.In = ["", *CELLS]
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.chdir(tmp_path)
    for number, cell in enumerate(CELLS[:3]):
        name = f"/tmp/ipykernel_1/{number}.py"
        monkeypatch.setitem(linecache.cache, name, (len(cell), None, cell.splitlines(True), name))
        exec(compile(cell, name, "exec"), main.__dict__)  # noqa: S102 - the test's own cells
    torch.manual_seed(0)
    with recorder.record(tmp_path / "run.zarr", mode="full"):
        main.CellBlock()(torch.randn(2, 3))
    return replayer.open(tmp_path / "run.zarr")


@recorder.paper_step("Eq. 11", description="a step in a module, given a notebook's object")
def scaled(cfg: Any, x: torch.Tensor) -> torch.Tensor:
    return x * cfg.scale


class TestNotebookSession:
    def test_code_defined_in_cells_replays_in_that_session(self, notebook_session: Any, tmp_path: Path) -> None:
        rec = notebook_session
        assert rec.run_info["script"] is None
        assert [(s.name, s.definition["ref"]) for s in rec.steps] == [
            ("CellBlock", "__main__:CellBlock"), ("cell_log", "__main__:cell_log")]
        for step in rec.steps:
            result = replayer.replay(rec, step.index)
            assert result.match and result.warnings == [], result.warnings
        # Another process has no such cells: told where the code is, no traceback
        done = pdbg("replay", str(tmp_path / "run.zarr"), "0", cwd=tmp_path)
        assert done.returncode == 2 and "Traceback" not in done.stderr
        assert "defined in __main__ of an interactive session" in done.stderr
        assert "bundle it there: replayer.bundle" in done.stderr and "jupyter nbconvert --to script" in done.stderr
        # ... which, its statements left out, replays the steps
        (tmp_path / "notebook.py").write_text("# In[1]:\n" + "\n# In[ ]:\n".join(CELLS[:3] + CELLS[4:]))
        done = pdbg("replay", str(tmp_path / "run.zarr"), "1", "--script", "notebook.py", cwd=tmp_path)
        assert done.returncode == 0 and "MATCH: bit for bit" in done.stdout, done.stdout + done.stderr
        assert not (tmp_path / "trained.txt").exists()

    def test_a_cells_code_is_named_as_ipython_names_it(self, notebook_session: Any,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
        """A step a cell defines is shown at "Cell In[2], line 2", as IPython's tracebacks name the cell, where
        its file is a temporary name of the kernel's ("/tmp/ipykernel_1/1.py:2", which is on no disk)."""
        cells = {f"/tmp/ipykernel_1/{n}.py": ("Cell", f"In[{n + 1}]") for n in (0, 1, 2, 9)}
        compiler = type("Compiler", (), {"format_code_name": staticmethod(cells.get)})()
        shell = type("Shell", (), {"compile": compiler})()
        monkeypatch.setitem(sys.modules, "IPython", type(os)("IPython"))
        monkeypatch.setattr(sys.modules["IPython"], "get_ipython", lambda: shell, raising=False)
        out = text(render("notebook_step", notebook_session.step(1)))
        assert "code Cell In[2], line 2 " in out and "ipykernel" not in out, out
        cell = CELLS[1].replace("return cell_log(self.lin(x).exp())", "return cell_log(self.lin(x).exp() + 1)")
        monkeypatch.setitem(linecache.cache, "/tmp/ipykernel_1/9.py", (len(cell), None, cell.splitlines(True),
                                                                        "/tmp/ipykernel_1/9.py"))
        exec(compile(cell, "/tmp/ipykernel_1/9.py", "exec"), sys.modules["__main__"].__dict__)  # noqa: S102
        assert "code of CellBlock changed since recording (Cell In[10], line 7; recorded at Cell In[2], line 7)" \
            in replayer.replay(notebook_session, 0).warnings
        monkeypatch.setattr(sys.modules["IPython"], "get_ipython", lambda: None)  # not in the kernel: its file
        assert "code /tmp/ipykernel_1/1.py:2 " in text(render("notebook_step", notebook_session.step(1)))

    def test_a_class_redefined_in_a_later_cell_is_named_as_changed(self, notebook_session: Any,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
        """A module class a cell defines has its source recorded, found through its methods (its
        module has no file), so a later cell redefining it is named as the cause of the MISMATCH
        (there was no warning: only functions' sources were recorded in a notebook)."""
        rec = notebook_session
        assert rec.steps[0].definition["source_sha256"], rec.steps[0].definition
        main = sys.modules["__main__"]
        cell = CELLS[1].replace("return cell_log(self.lin(x).exp())", "return cell_log(self.lin(x).exp() + 1)")
        name = "/tmp/ipykernel_1/9.py"
        monkeypatch.setitem(linecache.cache, name, (len(cell), None, cell.splitlines(True), name))
        exec(compile(cell, name, "exec"), main.__dict__)  # noqa: S102 - the test's own cell
        result = replayer.replay(rec, 0)
        assert not result.match and any(w.startswith("code of CellBlock changed since recording (/tmp/ipykernel_1/9.py")
                                        for w in result.warnings), result.warnings

    def test_a_bundle_made_in_the_session_carries_its_cells(self, notebook_session: Any, tmp_path: Path) -> None:
        info = replayer.bundle(notebook_session, 0, tmp_path / "failure.pdbg", verify=True)
        assert info.verified is True
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        done = pdbg("replay", str(info.path), cwd=elsewhere)
        assert done.returncode == 2 and "replay with --use-bundled-source" in done.stderr
        done = pdbg("replay", str(info.path), "--use-bundled-source", cwd=elsewhere)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "MATCH: bit for bit" in done.stdout and "warning" not in done.stdout
        assert list(elsewhere.iterdir()) == []  # the cells' definitions ran, not their statements

    def test_a_bundle_made_after_a_cell_redefined_the_step_replays_the_recorded_code(
            self, notebook_session: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        """A fix tried in a later cell, then the failure bundled to share: the bundle carries the
        recorded code after the cells, so it replays what the step ran, bit for bit (the last cell's
        definition won: a MISMATCH, "code of cell_log changed since recording")."""
        main = sys.modules["__main__"]
        fix = '@recorder.paper_step("Eq. 9", description="the log of a cell")\ndef cell_log(x):\n    ' \
              'return torch.log(x.clamp_min(1e-6))\n'
        name = "/tmp/ipykernel_1/9.py"
        monkeypatch.setitem(linecache.cache, name, (len(fix), None, fix.splitlines(True), name))
        exec(compile(fix, name, "exec"), main.__dict__)  # noqa: S102 - the test's own cell
        main.In.append(fix)
        step = notebook_session.step("cell_log")
        info = replayer.bundle(notebook_session, step.index, tmp_path / "failure.pdbg", verify=True)
        assert info.verified is True
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        done = pdbg("replay", str(info.path), "--use-bundled-source", cwd=elsewhere)
        assert done.returncode == 0 and "MATCH: bit for bit" in done.stdout, done.stdout + done.stderr
        assert "changed since recording" not in done.stdout

    def test_a_step_defined_in_a_time_cell_is_carried(self, notebook_session: Any, tmp_path: Path) -> None:
        """A cell under ``%%time`` (kept in ``In`` as ``get_ipython().run_cell_magic('time', '', BODY)``, a
        statement) defines its step in the session: the bundle carries BODY's definitions. It was refused
        ("the training script notebook-session.py (__main__) has no timed_cube now")."""
        main = sys.modules["__main__"]
        body = '@recorder.paper_step("Eq. 12")\ndef timed_cube(x):\n    return x ** 3 + 1\n'
        exec(compile(body, "<timed exec>", "exec"), main.__dict__)  # noqa: S102 - as %%time runs it: no source
        main.In.append(f"get_ipython().run_cell_magic('time', '', {body!r})\n")
        with recorder.record(tmp_path / "timed.zarr", mode="full"):
            main.timed_cube(torch.full((2,), 1.5))
        rec = replayer.open(tmp_path / "timed.zarr")
        info = replayer.bundle(rec, 0, tmp_path / "failure.pdbg", verify=True)
        assert info.verified is True
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        done = pdbg("replay", str(info.path), "--use-bundled-source", cwd=elsewhere)
        assert done.returncode == 0 and "MATCH: bit for bit" in done.stdout, done.stdout + done.stderr

    def test_what_the_carried_cells_leave_out_is_named_as_a_notebooks(
            self, notebook_session: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        """A bundle's replay runs the cells' definitions, not their statements: a name a cell's statement sets
        (``GAIN = math.sqrt(2)``) and a step a cell's statement defines are named as the notebook's, where the
        hint was the script's ("put the training under such a guard", "give the one that defines it with
        --script")."""
        main = sys.modules["__main__"]
        cells = ["import math\nGAIN = math.sqrt(2.0)\n",
                 '@recorder.paper_step("Eq. 13")\ndef gained(x):\n    return x * GAIN\n',
                 'exec(\'@recorder.paper_step("Eq. 14")\\ndef hidden(x):\\n    return x + 1\\n\')\n']
        for number, cell in enumerate(cells, start=20):
            name = f"/tmp/ipykernel_1/{number}.py"
            monkeypatch.setitem(linecache.cache, name, (len(cell), None, cell.splitlines(True), name))
            exec(compile(cell, name, "exec"), main.__dict__)  # noqa: S102 - the test's own cells
            main.In.append(cell)
        with recorder.record(tmp_path / "cells.zarr", mode="full"):
            main.gained(torch.ones(2))
            main.hidden(torch.ones(2))
        rec = replayer.open(tmp_path / "cells.zarr")
        info = replayer.bundle(rec, 0, tmp_path / "gained.pdbg")
        with pytest.raises(replayer.ReplayError, match=r"the notebook session's cells that the bundle carries "
                                                       r"define no hidden: .*define it in a plain cell or a module"):
            replayer.bundle(rec, 1, tmp_path / "hidden.pdbg", verify=True)
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        done = pdbg("replay", str(info.path), "--use-bundled-source", cwd=elsewhere)
        assert "GAIN is set in a cell of the notebook session by a statement (set at line" in done.stdout, done.stdout
        assert "__name__" not in done.stdout and "training script" not in done.stdout

    def test_a_session_whose_cells_cannot_be_read_is_refused(self, notebook_session: Any, tmp_path: Path) -> None:
        del sys.modules["__main__"].In  # a plain Python REPL keeps no history
        with pytest.raises(replayer.bundles.BundleError, match="defined in an interactive session"):
            replayer.bundle(notebook_session, 0, tmp_path / "failure.pdbg")
        assert not (tmp_path / "failure.pdbg").exists()

    def test_a_bundle_carries_the_cells_a_step_in_a_module_was_given_an_object_of(
            self, notebook_session: Any, tmp_path: Path) -> None:
        main = sys.modules["__main__"]
        with recorder.record(tmp_path / "run2.zarr", mode="full"):
            scaled(main.Config(), torch.ones(3))
        rec = replayer.open(tmp_path / "run2.zarr")
        assert rec.step(0).arguments["args"][0]["$dataclass"]["type"] == "__main__:Config"
        info = replayer.bundle(rec, 0, tmp_path / "failure.pdbg", verify=True)
        assert info.verified is True  # from the cells it carries, not from this kernel
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        done = pdbg("replay", str(info.path), "--use-bundled-source", cwd=elsewhere)
        assert done.returncode == 0 and "MATCH: bit for bit" in done.stdout, done.stdout + done.stderr


def test_a_step_says_which_parameters_were_frozen_at_its_call(tmp_path: Path) -> None:
    """A fine-tuning run with a frozen embedding and backbone: a step's notebook table listed every
    parameter alike, and its backward step had gradients for the head only, with nothing saying why.
    ``step.frozen`` names the parameters frozen at that call (a backward step's, at its forward call;
    the backbone thaws at iteration 2), and the table marks them."""
    from tests.models import record_fine_tuning

    with replayer.open(record_fine_tuning(tmp_path / "ft.zarr")) as rec:
        forward, backward, thawed = rec.step(0), rec.step(1), rec.step("FineTuned@iter=2")
        assert forward.frozen == backward.frozen == ["embed.weight", "backbone.weight", "backbone.bias"]
        assert thawed.frozen == ["embed.weight"]
        assert [r.name for r in backward.tensors("param_grad")] == ["head.bias", "head.weight"]
        out = text(render("frozen", forward))
        assert "frozen parameters embed.weight, backbone.weight, backbone.bias (requires_grad=False: no gradient)" \
            in out
        assert "frozen param embed.weight" in out and "frozen param head.weight" not in out and \
            " param head.weight" in out
        assert "frozen parameters embed.weight, backbone.weight, backbone.bias (requires_grad=False: no gradient " \
            "recorded)" in text(render("frozen_backward", backward))
        assert "frozen param backbone.weight" not in text(render("thawed", thawed))
    # Before schema 1.2 every record's requires_grad was false: such a recording does not say what was frozen.
    import shutil

    import zarr

    from tests.sealing import as_schema

    shutil.copytree(tmp_path / "ft.zarr", tmp_path / "old.zarr")
    column = zarr.open_group(tmp_path / "old.zarr" / "rank0", mode="r+")["tensors/requires_grad"]
    column.with_config({"write_empty_chunks": True})[:] = False
    as_schema(tmp_path / "old.zarr", "1.1")
    with replayer.open(tmp_path / "old.zarr") as old:
        assert old.step(0).frozen == old.step(1).frozen == []
        assert "frozen param" not in text(render("old", old.step(0)))


def test_an_origin_a_step_s_nan_check_raised_in_is_shown_as_one(tmp_path: Path) -> None:
    """A run that ended by a step's own NaN check (no recorded result holds the NaN) showed "No non-finite value
    found" with an "ok" badge in a notebook: it shows the step it raised in, the cause and, asked for, the
    operation; a run ended by a loss guard outside the steps says so, not "ok" either."""
    from tests.replayer.test_bisect import checked_update

    path = tmp_path / "run.zarr"
    torch.manual_seed(0)
    with pytest.raises(FloatingPointError), recorder.record(path):
        checked_update(torch.randn(6))
    origin = replayer.first_nonfinite(replayer.open(path), ops=True)
    out = text(render("origin_raised", origin))
    assert "First non-finite value: made inside a step that raised nonfinite" in out and "ok" not in out.split()
    assert f"raised in {origin.raised_in.selector}" in out and "operation aten::sqrt" in out, out
    assert "which returned no result" in out and f"replayer.replay(rec, {origin.raised_in.index})" in out
    guarded = tmp_path / "guarded.zarr"
    with pytest.raises(FloatingPointError), recorder.record(guarded):
        loss = nanmodels.root_energy(torch.tensor([1.0, 4.0])).sum() * float("nan")
        raise FloatingPointError(f"loss is {loss.item()}")
    out = text(replayer.first_nonfinite(replayer.open(guarded))._repr_html_())
    assert "the run ended by it, outside the recorded steps nonfinite" in out and "loss is nan" in out, out
