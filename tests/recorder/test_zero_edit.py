"""Zero-edit recording: `pdbg record --modules GLOB -- script.py`, and `record(modules=...)` in code."""

from __future__ import annotations

import contextlib
import json
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

import recorder
import replayer
from recorder.autohooks import glob_matches, parse_globs
from recorder.errors import RecordingError
from recorder.store import layout
from recorder.store.reader import RunReader
from tests.cli import SCRIPTS, pdbg, pdbg_here, python

SCRIPT = SCRIPTS / "plain_train.py"


def user_frames(stderr: str) -> list[str]:
    """The traceback's frames in the script, with their code lines, and the final error line."""
    lines = stderr.split("pdbg: ")[0].splitlines()
    out = [f"{a}|{b}" for a, b in zip(lines, lines[1:]) if a.startswith(f'  File "{SCRIPT}"')]
    return out + [lines[-1]] if lines else out


def steps(path: Path) -> list[dict[str, object]]:
    rank = RunReader(str(path)).rank(0)
    col = rank.column
    out = []
    for i in range(len(rank)):
        extra = int(col("steps/extra")[i])
        out.append({"index": i, "name": rank.doc(int(col("steps/name")[i])), "phase": int(col("steps/phase")[i]),
                    "iteration": int(col("steps/iteration")[i]), "path": rank.doc(int(col("steps/module_path")[i])),
                    "status": layout.STATUSES[int(col("steps/status")[i])], "parent": int(col("steps/parent")[i]),
                    "extra": rank.doc(extra) if extra >= 0 else {}})
    return out


class TestGlobs:
    def test_star_is_one_segment(self) -> None:
        """`blocks.*` selects each block, not the block's children nor the container."""
        (p,) = parse_globs("blocks.*")
        assert glob_matches(p, "blocks.0") and glob_matches(p, "blocks.12")
        assert not glob_matches(p, "blocks.0.fc") and not glob_matches(p, "blocks") and not glob_matches(p, "")

    def test_double_star_is_any_number_of_segments(self) -> None:
        """`**` alone selects every module, the root included; `**.attn` every attn at any depth."""
        every, attn = parse_globs(["**", "**.attn"])
        assert all(glob_matches(every, p) for p in ("", "a", "a.b.c"))
        assert glob_matches(attn, "attn") and glob_matches(attn, "h.3.attn") and not glob_matches(attn, "h.3.attn.q")

    def test_wildcards_inside_a_segment(self) -> None:
        """fnmatch wildcards apply within one segment."""
        (p,) = parse_globs("h.*.attn*")
        assert glob_matches(p, "h.1.attn_out") and not glob_matches(p, "h.1.mlp")

    @pytest.mark.parametrize("bad", ["", "a..b", ".a", 3])
    def test_bad_glob_is_refused_before_anything_is_created(self, bad: object, run_path: Path) -> None:
        """An empty segment is an error naming the glob, and no store is created."""
        with pytest.raises(RecordingError, match="invalid module glob"):
            recorder.record(run_path, modules=[bad])  # type: ignore[list-item]
        assert not run_path.exists()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        y = self.fc(x)
        return x + (y if scale is None else y * scale)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, scale=torch.full((6,), 0.5))
        return x.sum()


class TestInProcess:
    def test_modules_and_auto_optimizer(self, run_path: Path) -> None:
        """record(modules=..., optimizer="auto") records undecorated blocks, forward and backward,
        with keyword tensors as inputs and bit-exact payloads."""
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        xs = [torch.randn(3, 6, requires_grad=True) for _ in range(2)]
        with recorder.record(run_path, optimizer="auto", modules="blocks.*"):
            for x in xs:
                model(x).backward()
                opt.step()
                opt.zero_grad()
        got = steps(run_path)
        assert [(s["name"], s["phase"], s["iteration"], s["path"]) for s in got] == [
            (n, ph, it, p) for it in (0, 1) for n, ph, p in
            (("Block", 0, "blocks.0"), ("Block", 0, "blocks.1"), ("Block", 1, "blocks.1"), ("Block", 1, "blocks.0"))]
        rank = RunReader(str(run_path)).rank(0)
        recs = {(r.role, r.name): r for r in rank.tensor_records(4)}  # iteration 1, blocks.0 forward
        assert torch.equal(rank.tensor(recs[("input", "args.0")]), xs[1].detach())
        assert torch.equal(rank.tensor(recs[("input", "kwargs.scale")]), torch.full((6,), 0.5))
        back = {(r.role, r.name) for r in rank.tensor_records(7)}  # iteration 1, blocks.0 backward
        assert {("grad_output", "output"), ("grad_input", "args.0"), ("param_grad", "fc.weight")} <= back

    def test_decorated_class_matching_a_glob_is_recorded_once(self, run_path: Path) -> None:
        """A paper step that a glob also selects appears once per call, under its paper name."""
        from tests.models import Attention

        attn = Attention(8, 2, dropout=0.0)
        with recorder.record(run_path, modules="**"):
            attn(torch.randn(1, 4, 8))
        names = [(s["name"], s["path"]) for s in steps(run_path) if s["phase"] == 0]
        assert names.count(("Attention", "")) == 1
        assert ("Linear", "qkv") in names and ("Linear", "proj") in names

    def test_unmatched_glob_warns_with_the_paths_that_exist(self, run_path: Path) -> None:
        """A glob that selects nothing is reported once, listing the module paths that were called."""
        model = Net()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with recorder.record(run_path, modules=["blokcs.*"]) as run:
                model(torch.randn(2, 6))
        assert run.unmatched_globs == ["blokcs.*"]
        (w,) = [w for w in caught if issubclass(w.category, recorder.RecorderWarning)]
        assert "'blokcs.*' matched no module" in str(w.message) and "'blocks.0'" in str(w.message)

    def test_a_glob_spelled_as_a_module_path_selects_it_whatever_it_holds(self, run_path: Path) -> None:
        """modules=['heads.x[0]'] warned "matched no module" while listing heads.x[0] among the paths called:
        the brackets were a set of characters. A glob spelled exactly as the path (or with [[] for a literal
        [) selects it, under Unicode normalisation (a key in NFD, a glob typed in NFC); a glob holding [
        that selects nothing says how to write one, at the line of the user's code that recorded."""
        heads = nn.ModuleDict({k: nn.Linear(4, 4) for k in ("x[0]", "x0", "cafe\u0301")})
        model = nn.Sequential(heads)
        for k, (globs, paths) in enumerate(((["0.x[0]"], {"0.x[0]", "0.x0"}), (["0.x[[]*"], {"0.x[0]"}),
                                            (["0.caf\u00e9"], {"0.cafe\u0301"}), (["**.x[[]0]"], {"0.x[0]"}))):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with recorder.record(run_path.with_name(f"{k}.zarr"), model=model, modules=globs) as run:
                    for m in heads.values():
                        m(torch.randn(2, 4))
            assert run.unmatched_globs == [] and not caught, [str(w.message) for w in caught]
            assert {s["path"] for s in steps(run_path.with_name(f"{k}.zarr"))} == paths, globs
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with recorder.record(run_path, model=model, modules=["0.x[0]*", "0.y*"]) as run:
                heads["x[0]"](torch.randn(2, 4))
        (w,) = [w for w in caught if issubclass(w.category, recorder.RecorderWarning)]
        assert "'0.x[0]*', '0.y*' matched no module" in str(w.message) and "'0.x[0]'" in str(w.message)
        assert "write [[] for a literal [" in str(w.message) and w.filename == __file__, (w.filename, str(w.message))

    def test_a_glob_naming_a_paper_step_module_has_matched(self, run_path: Path) -> None:
        """A glob that names a module already recorded as a paper step: the step is recorded once, by
        its own wrapper, and the glob is not reported as matching nothing (nor its path left out of
        the paths called)."""
        @recorder.paper_step("Eq. 1")
        class Decorated(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.fc = nn.Linear(4, 4)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.fc(x)

        model = nn.Sequential(Decorated(), nn.Linear(4, 4))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with recorder.record(run_path, model=model, modules=["0", "1", "nothing"]) as run:
                model(torch.randn(2, 4))
        assert run.unmatched_globs == ["nothing"]
        (w,) = [w for w in caught if issubclass(w.category, recorder.RecorderWarning)]
        assert "'nothing' matched no module" in str(w.message) and "'0'," in str(w.message)
        assert [(s["name"].rpartition(".")[2], s["path"]) for s in steps(run_path)] == [("Decorated", "0"),
                                                                                         ("Linear", "1")]

    def test_exception_in_a_selected_module_is_recorded_and_reraised(self, run_path: Path) -> None:
        """An exception from an undecorated module's forward is recorded on its step, re-raised as is."""
        class Boom(nn.Module):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                raise ZeroDivisionError("no")

        net = nn.Sequential(nn.Linear(2, 2), Boom())
        with pytest.raises(ZeroDivisionError, match="no"), recorder.record(run_path, modules="*"):
            net(torch.randn(1, 2))
        got = steps(run_path)
        assert [(s["path"], s["status"]) for s in got] == [("0", "ok"), ("1", "exception")]
        assert got[1]["extra"]["exception"]["message"] == "no"
        assert RunReader(str(run_path)).status == "crashed"


class CachedBlock(nn.Module):
    """A decoder block that writes its key into a cache given by keyword (``kbuf=``) at row ``pos``,
    then attends over the rows so far; ``kscale`` 1e20 makes the key overflow to Inf."""

    def __init__(self) -> None:
        super().__init__()
        self.qk = nn.Linear(4, 8)
        self.kscale = 1.0

    def forward(self, x: torch.Tensor, *, kbuf: torch.Tensor, pos: int) -> torch.Tensor:
        q, k = self.qk(x).split(4, -1)
        k = k * self.kscale * self.kscale
        kbuf[:, pos] = k
        keys = kbuf[0, :pos + 1]
        return x + torch.softmax(q @ keys.T, -1) @ keys


class CachedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(CachedBlock() for _ in range(2))

    def forward(self, x: torch.Tensor, caches: list[torch.Tensor], pos: int) -> torch.Tensor:
        for block, kbuf in zip(self.blocks, caches):
            x = block(x, kbuf=kbuf, pos=pos)
        return x


def _decode(run_path: Path, boom_at: int | None = None, **kw: Any) -> list[torch.Tensor]:
    """Decode 3 positions of CachedNet, recorded with ``modules="blocks.*"``; returns the caches."""
    torch.manual_seed(0)
    model = CachedNet().eval()
    caches = [torch.zeros(1, 3, 4) for _ in model.blocks]
    with torch.no_grad(), recorder.record(run_path, mode="full", modules="blocks.*", **kw):
        x = torch.randn(1, 4)
        for pos in range(3):
            model.blocks[0].kscale = 1e20 if pos == boom_at else 1.0
            x = model(x, caches, pos)
    return caches


class TestKeywordArguments:
    """A glob-selected module's keyword arguments are captured when its call begins, as positional
    ones: a cache given by keyword and written in place was recorded as the call left it."""

    @pytest.mark.parametrize("model", [True, False], ids=["model", "no-model"])
    def test_a_keyword_buffer_written_in_place_is_recorded_as_the_call_found_it(self, run_path: Path,
                                                                               model: bool) -> None:
        """blocks.0 at position 1 gets kbuf with row 1 still zero, and leaves it written (after:kwargs.kbuf);
        from its first call, with record(model=...) or without it (its hook is added when the outermost
        module is called; before, the first call's were taken when it ended, as a note said)."""
        import replayer

        torch.manual_seed(0)
        net = CachedNet().eval()
        caches = [torch.zeros(1, 3, 4) for _ in net.blocks]
        with torch.no_grad(), recorder.record(run_path, mode="full", modules="blocks.*",
                                              **({"model": net} if model else {})):
            x = torch.randn(1, 4)
            for pos in range(3):
                x = net(x, caches, pos)
        rec = replayer.open(run_path)
        first, second = rec.step(0), rec.step(2)  # blocks.0 at positions 0 and 1
        assert second.module_path == "blocks.0"
        assert torch.equal(second.tensor("kwargs.kbuf")[0, 1], torch.zeros(4))
        assert torch.equal(second.tensor("kwargs.kbuf")[0, 0], caches[0][0, 0])
        assert torch.equal(second.tensor("after:kwargs.kbuf"), torch.cat([caches[0][:, :2], torch.zeros(1, 1, 4)], 1))
        late = [n for n in first.extra.get("notes", []) if layout.LATE_KWARGS_NOTE in n]
        assert torch.equal(first.tensor("kwargs.kbuf"), torch.zeros(1, 3, 4)) and not late
        assert not [n for n in second.extra.get("notes", []) if layout.LATE_KWARGS_NOTE in n]
        for step in rec.steps:
            res = replayer.replay(rec, step)
            assert res.match and all(d.max_ulp == 0 for d in res.outputs), (step.index, res)

    def test_a_copy_of_a_hooked_module_is_recorded_once_per_call_and_left_unhooked(self, run_path: Path) -> None:
        """copy.deepcopy of a model while recording (an EMA model) copies its modules' keyword pre-hook:
        each call of the copy is still one step, and neither keeps a hook after the recording closes."""
        import copy

        net = CachedNet().eval()
        caches = [torch.zeros(1, 3, 4) for _ in net.blocks]
        with torch.no_grad(), recorder.record(run_path, model=net, modules="blocks.*"):
            net(torch.randn(1, 4), caches, 0)
            ema = copy.deepcopy(net)
            for pos in range(2):
                ema(torch.randn(1, 4), caches, pos)
        got = steps(run_path)
        assert [(s["path"], s["parent"]) for s in got] == [("blocks.0", -1), ("blocks.1", -1)] * 3
        assert not [h for m in (*net.modules(), *ema.modules()) for h in m._forward_pre_hooks.values()]

    def test_a_copy_never_called_while_recording_drops_the_hook_and_saves_whole(self, run_path: Path) -> None:
        """A copy kept aside while recording (the best model so far) and used after it closed: its first call
        takes the recorder's pre-hook off (nothing of the recording is left on it), and torch.save of the whole
        module, before that call too, loads back and runs as the original."""
        import copy
        import io

        net = CachedNet().eval()
        caches = [torch.zeros(1, 3, 4) for _ in net.blocks]
        with torch.no_grad(), recorder.record(run_path, model=net, modules="blocks.*"):
            net(torch.randn(1, 4), caches, 0)
            best = copy.deepcopy(net)
        buffer = io.BytesIO()
        torch.save(best, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        x = torch.randn(1, 4)
        with torch.no_grad():
            want = net(x, [c.clone() for c in caches], 1)
            for model in (best, loaded):
                assert torch.equal(model(x, [c.clone() for c in caches], 1), want)
                assert not [h for m in model.modules() for h in m._forward_pre_hooks.values()]

    def test_bisect_names_the_op_that_overflowed_into_a_keyword_cache(self, run_path: Path) -> None:
        """The key overflows in blocks.0 at position 1 and is written into kbuf: bisect names that call
        and its aten::mul, not "came non-finite from code outside every recorded step"."""
        import replayer

        _decode(run_path, boom_at=1)
        rec = replayer.open(run_path)
        origin = replayer.first_nonfinite(rec, ops=True)
        assert origin.step is not None and origin.step.index == 2 and origin.step.module_path == "blocks.0", origin
        op = origin.op
        assert op is not None and op.name == "aten::mul" and op.code == "k = k * self.kscale * self.kscale", op


class Gate(nn.Module):
    """A gated linear layer whose gate comes as a positional or keyword-only argument, with dropout: its
    calls draw random numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.25)

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None, *, kgate: torch.Tensor | None = None,
                ) -> torch.Tensor:
        return self.drop(self.fc(x)) * torch.sigmoid(gate if kgate is None else kgate)


class GateNet(nn.Module):
    def __init__(self, keyword: bool) -> None:
        super().__init__()
        self.keyword = keyword
        self.g1 = Gate()

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self.g1(x, kgate=gate) if self.keyword else self.g1(x, gate)


def _positional(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return args[0] + 0.1 * torch.randn_like(args[0]), args[1] * 3.0 + 1.0


def _keyword(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    return (args[0] + 0.1 * torch.randn_like(args[0]),), {**kwargs, "kgate": kwargs["kgate"] * 3.0 + 1.0}


def _hooked_training(path: Path | None, keyword: bool, model: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Two iterations of GateNet whose g1 has a forward pre-hook that changes its arguments and draws
    random numbers, recorded (``path``) with ``modules=["g1"]``, or not; returns the losses and
    parameters."""
    torch.manual_seed(0)
    net = GateNet(keyword)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x, gate = torch.randn(3, 4), torch.randn(3, 4, requires_grad=True)
    if keyword:
        net.g1.register_forward_pre_hook(_keyword, with_kwargs=True)
    else:
        net.g1.register_forward_pre_hook(_positional)
    losses = []
    with contextlib.ExitStack() as stack:
        if path is not None:
            stack.enter_context(recorder.record(path, mode="full", modules=["g1"], optimizer=opt,
                                                **({"model": net} if model else {})))
        for _ in range(2):
            loss = net(x, gate.tanh()).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
    return losses, [p.detach().clone() for p in net.parameters()]


def _g1_replays(rec: Any) -> list[Any]:
    """Every step of a recording of two iterations of module g1 (forward, backward each), replayed: each
    matched bit for bit with outputs compared; their results."""
    assert [(s.phase, s.module_path) for s in rec.steps] == [("forward", "g1"), ("backward", "g1")] * 2
    results = [replayer.replay(rec, step.index) for step in rec.steps]
    for res in results:
        assert res.match and res.outputs and all(d.match for d in res.outputs), (res.step.index, res.diffs)
    return results


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.int32)


class TestOwnPreHooks:
    """A glob-selected module is recorded after its own forward pre-hooks ran: with the arguments its
    forward got, its state and the RNG states the hooks left, as a decorated class is."""

    @pytest.mark.parametrize("model", [True, False], ids=["model", "no-model"])
    @pytest.mark.parametrize("keyword", [False, True], ids=["positional", "keyword"])
    def test_forward_and_backward_replay_bit_for_bit(self, run_path: Path, keyword: bool, model: bool) -> None:
        """A pre-hook that changes a positional or keyword argument and draws noise: every forward
        and backward step replays bit for bit, without a word of the hook, and training is unchanged
        (it was recorded before the hook: every replay differed)."""
        plain = _hooked_training(None, keyword, model)
        recorded = _hooked_training(run_path, keyword, model)
        for a, b in zip([*plain[0], *plain[1]], [*recorded[0], *recorded[1]]):
            assert torch.equal(_bits(a), _bits(b))
        rec = replayer.open(run_path)
        for res in _g1_replays(rec):
            assert not any("pre-hook" in w for w in res.warnings), res.warnings
        first = rec.step(0)
        name = "kwargs.kgate" if keyword else "args.1"
        gate = first.tensor(name)  # the hook's: tanh(gate) * 3 + 1, not the caller's tanh(gate)
        assert gate.min() >= -2.0 and gate.max() <= 4.0 and gate.max() > 1.0, gate
        assert {d.name for d in replayer.replay(rec, 1).outputs} >= {name, "fc.weight"}

    def test_a_hook_registered_while_recording_is_noted_and_then_followed(self, run_path: Path) -> None:
        """A pre-hook registered after the module's first recorded call runs after the recorder's at
        the next call, which a note on the step says and whose replay names the hook as the likely
        cause of its difference; the recorder's hook goes last for the calls after it."""
        torch.manual_seed(0)
        net = GateNet(keyword=False)
        x, gate = torch.randn(3, 4), torch.randn(3, 4)
        with recorder.record(run_path, mode="full", model=net, modules=["g1"]):
            net(x, gate)
            net.g1.register_forward_pre_hook(_positional)
            net(x, gate)
            net(x, gate)
        rec = replayer.open(run_path)
        notes = [rec.step(i).extra.get("notes", []) for i in range(3)]
        assert notes[0] == [] and notes[2] == [], notes
        assert notes[1] == [f"_positional: {layout.UNRUN_PRE_HOOKS_NOTE}"], notes
        res = [replayer.replay(rec, i) for i in range(3)]
        assert res[0].match and res[2].match and not res[1].match
        assert f"_positional: {layout.UNRUN_PRE_HOOKS_NOTE} (a likely cause of any difference)" in res[1].warnings
        assert not any("pre-hook" in w for w in res[2].warnings), res[2].warnings


    def test_an_outermost_modules_first_call_is_noted_and_the_next_followed(self, run_path: Path) -> None:
        """A selected module called as the outermost one, with no model given: its first call is captured
        before its own pre-hook (a note says so, and its replay names the hook), its next after it."""
        torch.manual_seed(0)
        fc = nn.Linear(4, 4)
        fc.register_forward_pre_hook(_double)
        x = torch.randn(3, 4)
        with recorder.record(run_path, mode="full", modules=["**"]):
            fc(x)
            fc(x)
        rec = replayer.open(run_path)
        assert [rec.step(i).extra.get("notes", []) for i in range(2)] == [[f"_double: {layout.UNRUN_PRE_HOOKS_NOTE}"],
                                                                         []]
        first, second = replayer.replay(rec, 0), replayer.replay(rec, 1)
        assert not first.match and f"_double: {layout.UNRUN_PRE_HOOKS_NOTE} (a likely cause of any difference)" in \
            first.warnings
        assert second.match and not any("pre-hook" in w for w in second.warnings), second.warnings
        assert torch.equal(_bits(rec.step(1).tensor("args.0")), _bits(x * 2))


class TestOwnForwardHooks:
    """A glob-selected module's own forward hooks, which run after its recorded call, see the caller's
    keyword tensors, not the recorder's taps of them."""

    @staticmethod
    def _training(path: Path | None, seen: list[bool]) -> list[torch.Tensor]:
        torch.manual_seed(0)
        net = GateNet(keyword=True)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        x, gate = torch.randn(3, 4), torch.randn(3, 4, requires_grad=True)
        given: list[torch.Tensor] = []

        def uses_kgate(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: torch.Tensor,
                       ) -> torch.Tensor:
            seen.append(kwargs["kgate"] is given[-1])
            return out + kwargs["kgate"].sum()

        net.g1.register_forward_hook(uses_kgate, with_kwargs=True)
        out = []
        with recorder.record(path, mode="full", model=net, modules=["g1"], optimizer=opt) if path is not None \
                else contextlib.nullcontext():
            for _ in range(2):
                given.append(gate.tanh())
                loss = net.g1(x, kgate=given[-1]).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                out.append(loss.detach())
        return [*out, *(p.detach().clone() for p in net.parameters()), gate.grad.clone()]

    def test_a_hook_using_a_keyword_tensor_replays_bit_for_bit(self, run_path: Path) -> None:
        """A forward hook (with_kwargs) that adds a keyword tensor argument to the output: training is
        unchanged and every step replays bit for bit (the hook's use of the tap went into the recorded
        input gradient: every backward replay differed)."""
        plain_seen: list[bool] = []
        recorded_seen: list[bool] = []
        plain = self._training(None, plain_seen)
        recorded = self._training(run_path, recorded_seen)
        assert plain_seen == recorded_seen == [True, True]
        for a, b in zip(plain, recorded, strict=True):
            assert torch.equal(_bits(a), _bits(b))
        rec = replayer.open(run_path)
        _g1_replays(rec)
        assert "kwargs.kgate" in {d.name for d in replayer.replay(rec, 1).outputs}


def _double(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return (args[0] * 2,)


def forward_iterations(path: Path) -> list[int]:
    """The iteration of each forward step of blocks.0: one per batch of the loops below."""
    return [int(s["iteration"]) for s in steps(path) if s["phase"] == 0 and s["path"] == "blocks.0"]


def recorder_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, recorder.RecorderWarning)]


class TestIterations:
    """Which optimizer's steps end an iteration when there are several, or none."""

    @pytest.mark.parametrize("given", ["auto", "optimizer"])
    def test_a_new_optimizer_over_the_same_parameters_counts_from_its_first_step(self, run_path: Path,
                                                                                   given: str) -> None:
        """A checkpoint resumed into a new optimizer mid-run (the old one still referenced, as after
        unfreezing layers): its steps end the iterations. They ended none, and batches 3 to 5 were all
        in iteration 3, with nothing said; the run's metadata now says where it took over."""
        model = Net()
        opt = first = torch.optim.AdamW(model.parameters(), lr=1e-2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with recorder.record(run_path, optimizer=first if given == "optimizer" else "auto", modules="blocks.*"):
                for i in range(6):
                    if i == 3:
                        state = opt.state_dict()
                        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
                        opt.load_state_dict(state)
                    model(torch.randn(3, 6)).backward()
                    opt.step()
                    opt.zero_grad()
        assert forward_iterations(run_path) == [0, 1, 2, 3, 4, 5]
        final = RunReader(str(run_path)).rank(0).final
        assert final["iterations"] == 7  # (the last step opened iteration 6, where nothing ran)
        assert final["optimizer_replaced"] == {"count": 1, "iterations": [3], "optimizers": ["AdamW"]}
        assert recorder_warnings(caught) == []  # following it is what the user expects: nothing to warn of
        assert first is not opt

    def test_a_second_optimizer_over_other_parameters_ends_no_iteration(self, run_path: Path) -> None:
        """A GAN: the first optimizer to step (the discriminator's) counts; the generator's, over other
        parameters, stepping after it in every batch, does not."""
        gen, disc = nn.Linear(6, 6), Net()
        opt_d = torch.optim.SGD(disc.parameters(), lr=0.1)
        opt_g = torch.optim.SGD(gen.parameters(), lr=0.1)
        with recorder.record(run_path, optimizer="auto", modules="blocks.*"):
            for _ in range(4):
                disc(torch.randn(3, 6)).backward()
                opt_d.step()
                opt_d.zero_grad()
                gen(torch.randn(3, 6)).sum().backward()
                opt_g.step()
                opt_g.zero_grad()
        assert forward_iterations(run_path) == [0, 1, 2, 3]
        assert "optimizer_replaced" not in RunReader(str(run_path)).rank(0).final

    def test_a_step_gradscaler_skips_inside_the_given_wrapper_replaces_nothing(self, run_path: Path) -> None:
        """An optimizer wrapper that runs GradScaler inside its step (accelerate's AcceleratedOptimizer
        under fp16), given to record(): an overflow GradScaler skipped in the base optimizer was taken
        for a new optimizer replacing the wrapper ("optimizer replaced at iteration 2")."""
        class Wrapped(torch.optim.Optimizer):
            def __init__(self, base: torch.optim.Optimizer, scaler: Any) -> None:
                super().__init__(base.param_groups, base.defaults)
                self.base, self.scaler = base, scaler

            def step(self, closure: Any = None) -> None:  # type: ignore[override]
                self.scaler.step(self.base, closure)
                self.scaler.update()

        model = Net()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        opt = Wrapped(torch.optim.SGD(model.parameters(), lr=1e-2), scaler)
        with recorder.record(run_path, optimizer=opt, modules="blocks.*"):
            for i in range(5):
                loss = model(torch.randn(3, 6)) * (float("inf") if i == 2 else 1.0)
                scaler.scale(loss).backward()
                opt.step()
                opt.zero_grad()
        assert forward_iterations(run_path) == [0, 1, 2, 3, 4]
        assert "optimizer_replaced" not in RunReader(str(run_path)).rank(0).final

    def test_an_optimizer_stepped_inside_another_replaces_nothing(self, run_path: Path) -> None:
        """A wrapper optimizer (SAM, ZeroRedundancyOptimizer) over the same parameters steps its base
        optimizer inside its own step: one iteration per step, whichever of the two is given."""
        class Wrapper(torch.optim.Optimizer):
            def __init__(self, params: Any) -> None:
                super().__init__(params, {})
                self.base = torch.optim.SGD(self.param_groups, lr=0.1)

            def step(self, closure: Any = None) -> None:  # type: ignore[override]
                self.base.step()

        for name, pick in (("auto", lambda w: "auto"), ("wrapper", lambda w: w), ("base", lambda w: w.base)):
            model = Net()
            opt = Wrapper(model.parameters())
            path = run_path.with_name(f"{name}.zarr")
            with recorder.record(path, optimizer=pick(opt), modules="blocks.*"):
                for _ in range(3):
                    model(torch.randn(3, 6)).backward()
                    opt.step()
                    opt.zero_grad()
            assert forward_iterations(path) == [0, 1, 2], name
            assert "optimizer_replaced" not in RunReader(str(path)).rank(0).final, name

    def test_two_optimizers_stepping_shared_parameters_count_the_first_and_say_so(self, run_path: Path) -> None:
        """Both step every batch (an adversarial autoencoder's encoder): the second's first step looks
        like a replacement until the first steps again; then the first counts, and the extra iteration
        the second's first step made is named in a warning."""
        model = Net()
        opt_all = torch.optim.SGD(model.parameters(), lr=0.1)
        opt_some = torch.optim.Adam(model.blocks[0].parameters(), lr=0.1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with recorder.record(run_path, optimizer="auto", modules="blocks.*"):
                for _ in range(4):
                    for opt in (opt_all, opt_some):
                        model(torch.randn(3, 6)).backward()
                        opt.step()
                        opt.zero_grad()
        assert forward_iterations(run_path) == [0, 1, 2, 3, 3, 4, 4, 5]
        (said,) = recorder_warnings(caught)
        assert said == ("SGD and Adam step parameters they share: iterations follow the steps of the one that "
                        "stepped first only; the other's first step, taken for a new optimizer replacing it (a "
                        "resumed optimizer), ended iteration 1 early, and later iterations are numbered one higher")
        assert "optimizer_replaced" not in RunReader(str(run_path)).rank(0).final

    def test_an_optimizer_that_stops_while_another_steps_on_is_warned_of(self, run_path: Path) -> None:
        """An auxiliary model warmed up by its own optimizer, which is the first to step and so numbers
        the iterations, then stops; the policy's optimizer steps on: every later step falls into one
        iteration, and nothing said so. A GAN's optimizers, stepping in turn, are not warned of."""
        aux, policy = Net(), Net()
        warm = torch.optim.Adam(aux.parameters(), lr=1e-3)
        main = torch.optim.SGD(policy.parameters(), lr=1e-3)

        def train(steps: list[torch.optim.Optimizer]) -> list[str]:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with recorder.record(run_path.with_name(f"run{len(steps)}.zarr"), optimizer="auto", modules="blocks.*"):
                    for opt in steps:
                        (aux if opt is warm else policy)(torch.randn(3, 6)).backward()
                        opt.step()
                        opt.zero_grad()
            return recorder_warnings(caught)

        assert train([warm] * 2 + [main] * 5) == [
            "iteration 2 holds the last 5 steps of SGD, which numbers no iteration: iterations follow the first "
            "optimizer that stepped (Adam, 2 steps), which stopped stepping; give the one whose steps should number "
            "them to recorder.record(optimizer=...), or, for one made after the recording began (an adapters' "
            "optimizer once the base was frozen), call run.next_iteration() after each of its steps (README, "
            "\"How iterations are counted\")"]
        assert train([warm, main] * 4) == []

    def test_an_optimizer_made_mid_run_whose_steps_the_script_numbers_is_not_warned_of(self, run_path: Path) -> None:
        """LoRA attached mid-run: the base frozen, a new optimizer over the adapters only, which takes nothing
        over from the first. The warning's advice, run.next_iteration() after each of its steps, numbered the
        iterations, yet the recording still said the last iteration held every one of those steps."""
        model = Net()
        first = torch.optim.SGD(model.parameters(), lr=1e-3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with recorder.record(run_path, model=model, optimizer=first, modules="blocks.*") as run:
                for opt in [first] * 2:
                    model(torch.randn(3, 6)).backward()
                    opt.step()
                    opt.zero_grad()
                model.requires_grad_(False)
                adapter = torch.nn.Parameter(torch.zeros(6))
                adapters = torch.optim.AdamW([adapter], lr=1e-2)
                for _ in range(4):
                    (model(torch.randn(3, 6) + adapter)).backward()
                    adapters.step()
                    adapters.zero_grad()
                    run.next_iteration()
        assert forward_iterations(run_path) == [0, 1, 2, 3, 4, 5]
        assert recorder_warnings(caught) == []

    def test_a_hand_written_update_is_warned_of_at_the_end(self, run_path: Path) -> None:
        """No torch.optim optimizer steps: every step is in iteration 0, and the recording says so once,
        when it closes, with how to mark the iterations (it said nothing)."""
        model = Net()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with recorder.record(run_path, optimizer="auto", modules="blocks.*"):
                _train_by_hand(model, 3)
        assert forward_iterations(run_path) == [0, 0, 0]
        assert recorder_warnings(caught) == [
            "every step is in iteration 0: 3 backward passes ran and no torch.optim optimizer stepped (iterations "
            "advance on optimizer.step()); to number the iterations of a hand-written update, record in code with "
            "recorder.record and call run.next_iteration() after each update (README, \"How iterations are "
            "counted\")"]
        with warnings.catch_warnings(record=True) as caught:  # marked by hand: nothing to say
            warnings.simplefilter("always")
            with recorder.record(run_path.with_name("marked.zarr"), optimizer="auto", modules="blocks.*") as run:
                for _ in range(3):
                    model(torch.randn(3, 6)).backward()
                    run.next_iteration()
        assert recorder_warnings(caught) == []

    def test_an_optimizer_not_given_to_record_is_warned_of_once_at_the_end(self, run_path: Path) -> None:
        """record() without optimizer= counts no iterations: a torch.optim optimizer that stepped five times
        put every step in iteration 0 in silence. The recording says so once, when it closes, naming the
        optimizer and what to pass; nothing where the iterations were marked by hand, or nothing ran after
        the only step."""
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with recorder.record(run_path, modules="blocks.*"):
                for _ in range(5):
                    model(torch.randn(3, 6)).backward()
                    opt.step()
                    opt.zero_grad()
        assert forward_iterations(run_path) == [0] * 5
        assert recorder_warnings(caught) == [
            "every step is in iteration 0: SGD.step() ran 5 times, but record() was given no optimizer, so none "
            "ended an iteration; pass optimizer=your_optimizer (or optimizer=\"auto\") to recorder.record, or call "
            "run.next_iteration() after each update (README, \"How iterations are counted\")"]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with recorder.record(run_path.with_name("marked.zarr"), modules="blocks.*") as run:
                for _ in range(3):
                    model(torch.randn(3, 6)).backward()
                    opt.step()
                    run.next_iteration()
            with recorder.record(run_path.with_name("one.zarr"), modules="blocks.*"):
                model(torch.randn(3, 6)).backward()
                opt.step()
        assert recorder_warnings(caught) == []


    def test_a_resumed_run_numbers_its_iterations_from_start_iteration(self, run_path: Path) -> None:
        """A run resumed from a checkpoint saved at step 15 (start_iteration=15): its iterations are the
        run's own numbers, 15 on (they were 0 on: a NaN at the run's step 17 read as iteration 2), for
        selectors too; final.iterations counts those begun from 15; payloads every k-th iteration are kept
        at the uninterrupted run's (multiples of k); a hand-written update is still warned of."""
        import replayer

        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        with recorder.record(run_path, optimizer=opt, modules="blocks.*", every=2, start_iteration=15) as run:
            assert run.iteration == 15
            for _ in range(4):
                model(torch.randn(3, 6)).backward()
                opt.step()
                opt.zero_grad()
        assert forward_iterations(run_path) == [15, 16, 17, 18]
        reader = RunReader(str(run_path)).rank(0)
        assert reader.run_info["start_iteration"] == 15
        assert reader.final["iterations"] == 5  # 15 to 18 hold steps; the last step opened 19
        rec = replayer.open(run_path)
        assert rec.step("Block@iter=17").iteration == 17 and rec.step("Block@iter=17").module_path == "blocks.0"
        kept = {s.iteration for s in rec.steps if all(r.has_payload for r in s.records)}
        assert kept == {16, 18}
        info = json.loads(pdbg_here("info", str(run_path), "--json", cwd=run_path.parent).stdout)
        assert info["tensors_kept"] == "every 2 iterations (--every 2: iterations 16, 18, 20, ...)"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with recorder.record(run_path.with_name("hand.zarr"), optimizer="auto", modules="blocks.*",
                                 start_iteration=7):
                _train_by_hand(model, 3)
        assert forward_iterations(run_path.with_name("hand.zarr")) == [7, 7, 7]
        assert recorder_warnings(caught) == [
            "every step is in iteration 7: 3 backward passes ran and no torch.optim optimizer stepped (iterations "
            "advance on optimizer.step()); to number the iterations of a hand-written update, record in code with "
            "recorder.record and call run.next_iteration() after each update (README, \"How iterations are "
            "counted\")"]

    @pytest.mark.parametrize("bad", [-1, 2.0, True, "15", None])
    def test_a_bad_start_iteration_is_refused_before_anything_is_created(self, run_path: Path, bad: object) -> None:
        with pytest.raises(RecordingError) as caught:
            recorder.record(run_path, start_iteration=bad)
        assert str(caught.value) == (f"start_iteration must be an integer >= 0 (the first iteration's number: for "
                                     f"a resumed run, the step its checkpoint was saved at), not {bad!r}")
        assert not run_path.exists()


def _train_by_hand(model: torch.nn.Module, iterations: int) -> None:
    """A hand-written update (no torch.optim optimizer): what optimizer="auto" cannot count."""
    for _ in range(iterations):
        model(torch.randn(3, 6)).backward()
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.1 * p.grad)
                p.grad = None


class TestPdbgRecord:
    def test_records_each_block_call_and_changes_nothing(self, tmp_path: Path) -> None:
        """`pdbg record --modules 'blocks.*'`: one forward and one backward step per block call, the
        right iterations, and the script's stdout, exit code and final parameters unchanged."""
        plain = python(str(SCRIPT), "4", "--save", str(tmp_path / "plain.pt"), cwd=tmp_path)
        rec = pdbg("record", "-o", "run.zarr", "--modules", "blocks.*", "--", str(SCRIPT), "4", "--save",
                   str(tmp_path / "rec.pt"), cwd=tmp_path)
        assert plain.returncode == 0 and rec.returncode == 0, rec.stderr
        assert rec.stdout == plain.stdout
        a, b = torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "rec.pt")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        got = steps(tmp_path / "run.zarr")
        expect = [x for it in range(4) for x in
                  [(f"blocks.{i}", 0, it) for i in range(3)] + [(f"blocks.{i}", 1, it) for i in (2, 1, 0)]]
        assert [(s["path"], s["phase"], s["iteration"]) for s in got] == expect
        assert {s["name"] for s in got} == {"Block"}
        info = RunReader(str(tmp_path / "run.zarr")).run_info
        assert info["script"] == str(SCRIPT) and info["argv"][1:] == ["4", "--save", str(tmp_path / "rec.pt")]
        assert "pdbg: recording in run.zarr (complete, 24 steps)" in rec.stderr

    def test_start_iteration_numbers_a_resumed_script_and_info_shows_the_range(self, tmp_path: Path) -> None:
        """`pdbg record --start-iteration 15`: a script resumed from the checkpoint of step 15 numbers its
        iterations 15 on (there was no option: a zero-edit recording of a resumed run was numbered from 0),
        and `pdbg info` shows their range where it does not start at 0 ("4 iterations" said nothing of
        it), in text and JSON; a bad value is one line, exit 2, and nothing runs."""
        rec = pdbg("record", "-o", "run.zarr", "--modules", "blocks.*", "--start-iteration", "15", "--",
                   str(SCRIPT), "4", cwd=tmp_path)
        assert rec.returncode == 0, rec.stderr
        assert sorted({int(s["iteration"]) for s in steps(tmp_path / "run.zarr")}) == [15, 16, 17, 18]
        info = pdbg_here("info", "run.zarr", cwd=tmp_path)
        assert info.stdout.startswith("run.zarr: complete, 24 steps, 4 iterations (15–18), 1 rank,"), info.stdout
        doc = json.loads(pdbg_here("info", "run.zarr", "--json", cwd=tmp_path).stdout)
        assert (doc["iterations"], doc["iteration_range"]) == (4, [15, 18])
        assert doc["rank_details"][0]["iteration_range"] == [15, 18]
        plain = pdbg("record", "-o", "plain.zarr", "--modules", "blocks.*", "--", str(SCRIPT), "2", cwd=tmp_path)
        assert plain.returncode == 0, plain.stderr
        info = pdbg_here("info", "plain.zarr", cwd=tmp_path)
        assert info.stdout.startswith("plain.zarr: complete, 12 steps, 2 iterations, 1 rank,"), info.stdout
        assert json.loads(pdbg_here("info", "plain.zarr", "--json", cwd=tmp_path).stdout)["iteration_range"] == [0, 1]
        bad = pdbg("record", "-o", "bad.zarr", "--start-iteration", "-3", "--", str(SCRIPT), "2", cwd=tmp_path)
        assert bad.returncode == 2 and bad.stdout == "" and bad.stderr == (
            "pdbg: error: --start-iteration must be an integer >= 0 (the first iteration's number: for a resumed run, "
            "the step its checkpoint was saved at), not -3\n")
        assert not (tmp_path / "bad.zarr").exists()

    def test_a_crash_keeps_traceback_and_exit_code(self, tmp_path: Path) -> None:
        """A script dying mid-iteration: same exit code and traceback as without recording, the run
        `crashed`, the exception on the innermost step."""
        plain = python(str(SCRIPT), "5", "--fail-at", "2", cwd=tmp_path)
        rec = pdbg("record", "-o", "run.zarr", "--modules", "**", "--", str(SCRIPT), "5", "--fail-at", "2",
                   cwd=tmp_path)
        assert plain.returncode == rec.returncode == 1
        assert rec.stdout == plain.stdout
        # The script's own frames and the error line are the same; torch's module-call frames differ
        # only because hooks take another path through nn.Module._call_impl.
        assert user_frames(rec.stderr) == user_frames(plain.stderr) != []
        assert rec.stderr.startswith("Traceback (most recent call last):\n")
        assert RunReader(str(tmp_path / "run.zarr")).status == "crashed"
        failed = [s for s in steps(tmp_path / "run.zarr") if s["status"] == "exception"]
        assert [(s["path"], s["iteration"]) for s in failed] == [("", 2), ("blocks.1", 2)]
        assert failed[-1]["extra"]["exception"]["type"] == "builtins:FloatingPointError"
        assert "FloatingPointError escaped step" in rec.stderr and "Block at blocks.1, iteration 2" in rec.stderr
        index = failed[-1]["index"]
        # the one command, at the failing step (pdbg, or the one beside this Python where pdbg is not on the PATH)
        assert re.search(rf"open it there: \S*pdbg run.zarr --at {index}\n", rec.stderr), rec.stderr

    def test_script_exit_code_is_returned(self, tmp_path: Path) -> None:
        """sys.exit(3) in the script is pdbg's exit code; the recording is closed as crashed, and says
        why (it said nothing: no exception, no step status)."""
        rec = pdbg("record", "-o", "run.zarr", "--", str(SCRIPT), "1", "--exit", "3", cwd=tmp_path)
        assert rec.returncode == 3
        assert RunReader(str(tmp_path / "run.zarr")).status == "crashed"
        assert "Traceback" not in rec.stderr  # an exit code is not an error to show
        info = pdbg_here("info", "run.zarr", cwd=tmp_path)
        assert "ended by: SystemExit: 3" in info.stdout.splitlines()
        assert json.loads(pdbg_here("info", "run.zarr", "--json", cwd=tmp_path).stdout)["ended_by"] == "SystemExit: 3"

    def test_missing_script_is_a_one_line_error_and_creates_nothing(self, tmp_path: Path) -> None:
        """A script that does not exist: exit 2, one line naming it, no store."""
        rec = pdbg("record", "-o", "run.zarr", "--", "nope.py", cwd=tmp_path)
        assert rec.returncode == 2
        assert rec.stderr.strip().splitlines() == ["pdbg: error: nope.py: no such file; give the path of the "
                                                   "Python script to record"]
        assert not (tmp_path / "run.zarr").exists()

    def test_unwritable_output_is_a_one_line_error_and_leaves_nothing(self, tmp_path: Path) -> None:
        """An output that cannot be created: exit 2, one line, nothing left behind, the script not run."""
        blocker = tmp_path / "file"
        blocker.write_text("not a directory")
        rec = pdbg("record", "-o", str(blocker / "run.zarr"), "--", str(SCRIPT), "1", cwd=tmp_path)
        assert rec.returncode == 2 and rec.stdout == ""
        (line,) = rec.stderr.strip().splitlines()
        assert line == (f"pdbg: error: cannot create {blocker / 'run.zarr'}: {blocker} is a file, not a directory; "
                        "choose another output path"), line  # (it said "is not writable")
        assert blocker.read_text() == "not a directory"
        rec = pdbg("record", "-o", str(blocker), "--", str(SCRIPT), "1", cwd=tmp_path)
        assert rec.returncode == 2 and rec.stderr.strip() == (
            f"pdbg: error: {blocker} is a file; give the path of a new directory for the recording")
        # An empty path was read as the working directory (". already exists and is not empty")
        empty = "the recording's path is empty; give the path of a new directory for it (runs/run.zarr)"
        rec = pdbg("record", "-o", "", "--", str(SCRIPT), "1", cwd=tmp_path)
        assert (rec.returncode, rec.stdout, rec.stderr.strip()) == (2, "", f"pdbg: error: {empty}")
        with pytest.raises(recorder.RecordingError, match=re.escape(empty)):
            recorder.record("")

    def test_glob_matching_nothing_warns_with_paths(self, tmp_path: Path) -> None:
        """A --modules glob that matches no module: a one-line warning listing the paths that exist."""
        rec = pdbg("record", "-o", "run.zarr", "--modules", "layers.*", "--", str(SCRIPT), "1", cwd=tmp_path)
        assert rec.returncode == 0
        (warn,) = [ln for ln in rec.stderr.splitlines() if ln.startswith("pdbg: warning:")]
        assert "'layers.*' matched no module" in warn and "'blocks.0'" in warn and "'head'" in warn


def test_pdbg_record_of_a_script_that_records_itself_says_so(tmp_path):
    """The script's own recorder.record raised "a recording is already active ... run.close() on the
    Run that recorder.record returned" with a traceback, about a recording pdbg had opened, and left
    pdbg's store behind with 0 steps."""
    (tmp_path / "mine.py").write_text(
        "import torch, recorder\n\n\n@recorder.paper_step('Eq. 1')\ndef double(x):\n    return x * 2\n\n\n"
        "with recorder.record('own.zarr'):\n    double(torch.ones(2))\n")
    for mode in ("full", "flight"):
        res = pdbg("record", "--mode", mode, "-o", "run.zarr", "--", "mine.py", cwd=tmp_path)
        assert res.returncode == 2 and res.stderr == (
            "pdbg: error: mine.py records itself (it calls recorder.record, a second recording in the process pdbg "
            "record runs it in): run it with python, or take its record() out to record it with pdbg record\n"), \
            res.stderr
        assert not (tmp_path / "run.zarr").exists()


def test_pdbg_record_that_records_no_step_says_what_to_name(tmp_path):
    """A plain script recorded without --modules: "recording in run.zarr (complete, 0 steps)", and
    nothing said that its modules must be named."""
    (tmp_path / "plain.py").write_text("import torch\nfrom torch import nn\n\nnet = nn.Sequential(nn.Linear(4, 4))\n"
                                       "net(torch.randn(2, 4)).sum().backward()\n")
    res = pdbg("record", "-o", "run.zarr", "--", "plain.py", cwd=tmp_path)
    assert res.returncode == 0 and res.stderr.rstrip().splitlines()[-1] == (
        "pdbg: recording in run.zarr (complete, 0 steps); no step was recorded: the script marks no paper step; "
        "name its modules with --modules (module paths from the outermost module called: 'blocks.*', or '**' for "
        "every one)"), res.stderr
    res = pdbg("record", "-o", "other.zarr", "--modules", "0", "--", "plain.py", cwd=tmp_path)
    assert res.stderr.rstrip().endswith("other.zarr (complete, 2 steps)"), res.stderr


def test_pdbg_record_of_a_script_whose_steps_run_in_spawned_processes_says_so(tmp_path):
    """A script that trains in processes it spawns (torch.multiprocessing.spawn's ranks) was told that it
    "marks no paper step", though it marks them: they ran where pdbg record does not reach."""
    (tmp_path / "spawns.py").write_text(
        "import multiprocessing, torch, recorder\n\n\n@recorder.paper_step('Eq. 1')\ndef double(x):\n"
        "    return x * 2\n\n\ndef work():\n    double(torch.ones(2))\n\n\nif __name__ == '__main__':\n"
        "    child = multiprocessing.get_context('spawn').Process(target=work)\n    child.start()\n    child.join()\n")
    res = pdbg("record", "-o", "run.zarr", "--", "spawns.py", cwd=tmp_path)
    assert res.returncode == 0 and res.stderr.rstrip().splitlines()[-1] == (
        "pdbg: recording in run.zarr (complete, 0 steps); no step was recorded: the script marks paper steps "
        "(double) but called none in this process; where its training runs in processes it starts "
        "(torch.multiprocessing.spawn, a multiprocessing Process), which pdbg record does not reach, record in each "
        "with recorder.record(PATH) (every rank into the same path), or start the ranks with torchrun --no-python "
        "pdbg record"), res.stderr


def test_pdbg_record_of_a_script_that_dies_before_any_module_says_so(tmp_path):
    """A script that dies loading its data, before its first forward: the summary said that --modules
    matched no module and pointed at a warning listing the paths called, which there was not."""
    (tmp_path / "early.py").write_text("import torch\nfrom torch import nn\n\nnet = nn.Sequential(nn.Linear(4, 4))\n"
                                       "open('no_such_data.csv')\nnet(torch.randn(2, 4))\n")
    for mode in ("full", "flight"):
        res = pdbg("record", "--mode", mode, "-o", f"{mode}.zarr", "--modules", "0", "--", "early.py", cwd=tmp_path)
        assert res.returncode == 1 and res.stderr.rstrip().splitlines()[-1] == (
            f"pdbg: recording in {mode}.zarr (crashed, 0 steps); no step was recorded: the script raised "
            "FileNotFoundError before it called any module"), res.stderr


RESUMED = """import torch
from torch import nn

torch.manual_seed(0)
net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
for i in range(8):
    if i == 4:  # resumed from a checkpoint, as a restarted job does
        state = opt.state_dict()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        opt.load_state_dict(state)
    net(torch.randn(8, 4)).square().mean().backward()
    {update}
"""


def test_pdbg_record_follows_a_resumed_optimizer_and_warns_of_a_hand_written_one(tmp_path):
    """A new optimizer loaded from a checkpoint mid-run: `pdbg info` said 5 iterations for 8, the
    fifth holding four batches; it says 8 and where the optimizer was replaced. Parameters updated by
    hand: one iteration, and nothing said; a warning says it, once, at the end."""
    (tmp_path / "resumed.py").write_text(RESUMED.format(update="opt.step(); opt.zero_grad()"))
    res = pdbg("record", "-o", "run.zarr", "--modules", "*", "--", "resumed.py", cwd=tmp_path)
    assert res.returncode == 0 and "warning" not in res.stderr, res.stderr
    info = pdbg_here("info", "run.zarr", cwd=tmp_path).stdout.splitlines()
    assert info[0].startswith("run.zarr: complete, 48 steps, 8 iterations,"), info
    assert ("optimizer replaced at iteration 4 (AdamW): a new optimizer over the same parameters (resumed or "
            "re-created) counts the iterations from its first step, which ends that iteration") in info
    doc = json.loads(pdbg_here("info", "run.zarr", "--json", cwd=tmp_path).stdout)
    assert doc["iterations"] == 8 and doc["optimizer_replaced"] == {"count": 1, "iterations": [4],
                                                                     "optimizers": ["AdamW"]}
    by_hand = ("with torch.no_grad():\n        for p in net.parameters():\n            p -= 0.01 * p.grad\n"
               "            p.grad = None")
    (tmp_path / "by_hand.py").write_text(RESUMED.format(update=by_hand))
    res = pdbg("record", "-o", "hand.zarr", "--modules", "*", "--", "by_hand.py", cwd=tmp_path)
    assert res.returncode == 0
    assert [ln for ln in res.stderr.splitlines() if ln.startswith("pdbg: warning:")] == [
        "pdbg: warning: every step is in iteration 0: 8 backward passes ran and no torch.optim optimizer stepped "
        "(iterations advance on optimizer.step()); to number the iterations of a hand-written update, record in "
        "code with recorder.record and call run.next_iteration() after each update (README, \"How iterations are "
        "counted\")"], res.stderr
    assert json.loads(pdbg_here("info", "hand.zarr", "--json", cwd=tmp_path).stdout)["optimizer_replaced"] is None


@pytest.mark.parametrize("mode", ["full", "flight"])
def test_pdbg_record_of_a_script_interrupted_before_its_steps_names_them(tmp_path, mode):
    """A Ctrl-C while the first batch loads, before any paper step ran: the summary said that the script
    "marks no paper step" and advised --modules, though it marks them (its globals were lost with the
    exception, and flight mode's child did not pass them on)."""
    (tmp_path / "early.py").write_text("import recorder, torch\n\n\n@recorder.paper_step('Eq. 1')\ndef double(x):\n"
                                       "    return x * 2\n\n\nraise KeyboardInterrupt\n")
    res = pdbg("record", "--mode", mode, "-o", "run.zarr", "--", "early.py", cwd=tmp_path)
    assert res.returncode == 130 and res.stderr.rstrip().splitlines()[-1] == (
        "pdbg: recording in run.zarr (crashed, 0 steps); no step was recorded: the script raised KeyboardInterrupt "
        "before it called its paper steps (double)"), res.stderr
