"""A small transformer (two decorated classes, one decorated function) trained 5 iterations with
dropout: the recording holds every forward call and every backward, in order, with the right phase,
iteration, parent and module path; parameters are stored once per distinct value; statistics agree
with torch's own."""

from __future__ import annotations

import gc
import hashlib
import inspect
import os
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import pytest
import torch

import recorder
import replayer
from recorder.store.reader import RunReader
from tests.cli import ROOT, pdbg, python
from tests.models import record_training

ITERATIONS = 5


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    snapshots = []  # parameter values at the start of every iteration (what each step sees)
    path = tmp_path_factory.mktemp("structure") / "run.zarr"
    record_training(path, ITERATIONS,
                    lambda i, model: snapshots.append({n: p.detach().clone() for n, p in model.named_parameters()}))
    reader = RunReader(path)
    return reader, reader.rank(0), snapshots


def rows(rank):
    out = []
    for i in range(len(rank)):
        col = lambda n: rank.column(f"steps/{n}")[i]  # noqa: E731
        out.append({"index": i, "name": rank.doc(int(col("name"))), "phase": int(col("phase")),
                    "iteration": int(col("iteration")), "call": int(col("call")), "parent": int(col("parent")),
                    "forward": int(col("forward")), "path": rank.doc(int(col("module_path"))),
                    "status": int(col("status"))})
    return out


FORWARD_ORDER = [("Block", "h.0", None), ("Attention", "h.0.attn", "h.0"), ("smooth_relu", "h.0.mlp", "h.0"),
                 ("Block", "h.1", None), ("Attention", "h.1.attn", "h.1"), ("smooth_relu", "h.1.mlp", "h.1")]


class TestOrderAndLinks:
    def test_every_forward_call_in_program_order(self, recorded):
        """Per iteration, forward steps appear in call order with their name, module path and parent."""
        _, rank, _ = recorded
        steps = rows(rank)
        assert len(steps) == ITERATIONS * 12
        for it in range(ITERATIONS):
            fwd = [s for s in steps if s["iteration"] == it and s["phase"] == 0]
            assert [(s["name"], s["path"]) for s in fwd] == [(n, p) for n, p, _ in FORWARD_ORDER]
            by_path = {s["path"]: s for s in fwd if s["name"] == "Block"}
            counts: dict[str, int] = {}
            for s, (_, _, parent) in zip(fwd, FORWARD_ORDER):
                assert s["parent"] == (by_path[parent]["index"] if parent else -1)
                assert s["call"] == counts.get(s["name"], 0)  # calls of that step so far in the iteration
                counts[s["name"]] = s["call"] + 1

    def test_every_backward_linked_to_its_forward(self, recorded):
        """Each forward call has exactly one backward step, same name/path/call/iteration, after it."""
        _, rank, _ = recorded
        steps = rows(rank)
        bwd = [s for s in steps if s["phase"] == 1]
        assert len(bwd) == ITERATIONS * 6
        linked = sorted(s["forward"] for s in bwd)
        assert linked == sorted(s["index"] for s in steps if s["phase"] == 0)
        for s in bwd:
            f = steps[s["forward"]]
            assert (f["name"], f["path"], f["call"], f["iteration"]) == (s["name"], s["path"], s["call"],
                                                                          s["iteration"])
            assert s["index"] > f["index"]

    def test_backward_order_and_nesting(self, recorded):
        """Backward steps run after the iteration's forwards, outer before inner, last block first."""
        _, rank, _ = recorded
        steps = rows(rank)
        for it in range(ITERATIONS):
            its = [s for s in steps if s["iteration"] == it]
            phases = [s["phase"] for s in its]
            assert phases == [0] * 6 + [1] * 6  # all forwards, then all backwards
            assert [s["index"] for s in its] == list(range(its[0]["index"], its[0]["index"] + 12))
            bwd = [s for s in its if s["phase"] == 1]
            blocks = [s["path"] for s in bwd if s["name"] == "Block"]
            assert blocks == ["h.1", "h.0"]
            for s in bwd:
                fparent = steps[s["forward"]]["parent"]
                if fparent == -1:
                    assert s["parent"] == -1
                else:
                    parent = steps[s["parent"]]
                    assert parent["phase"] == 1 and parent["forward"] == fparent
                    assert parent["index"] < s["index"]

    def test_tensor_roles(self, recorded):
        """Forward steps hold inputs, params, outputs (and watches); backward steps the gradients."""
        _, rank, _ = recorded
        steps = rows(rank)
        block_f = next(s for s in steps if s["name"] == "Block" and s["phase"] == 0)
        recs = rank.tensor_records(block_f["index"])
        names = {(r.role, r.name) for r in recs}
        assert ("input", "args.0") in names and ("output", "output") in names
        assert ("param", "attn.qkv.weight") in names and ("param", "mlp.fc.bias") in names
        attn_f = next(s for s in steps if s["name"] == "Attention" and s["phase"] == 0)
        assert ("watch", "attention_weights") in {(r.role, r.name) for r in rank.tensor_records(attn_f["index"])}
        block_b = next(s for s in steps if s["name"] == "Block" and s["phase"] == 1)
        bnames = {(r.role, r.name) for r in rank.tensor_records(block_b["index"])}
        assert {("grad_output", "output"), ("grad_input", "args.0"), ("param_grad", "attn.qkv.weight")} <= bnames
        relu_f = next(s for s in steps if s["name"] == "smooth_relu" and s["phase"] == 0)
        args = rank.doc(int(rank.column("steps/args")[relu_f["index"]]))
        assert args == {"args": [{"$tensor": "args.0"}], "kwargs": {"beta": 0.5}}


class TestPayloads:
    def test_parameters_stored_once_per_distinct_value(self, recorded):
        """Distinct parameter payloads == distinct parameter values, asserted exactly."""
        _, rank, snapshots = recorded
        steps = rows(rank)
        payload_ids, values = set(), set()
        for s in steps:
            if s["phase"] != 0 or s["name"] == "smooth_relu":
                continue
            prefix = s["path"] + "."
            for rec in rank.tensor_records(s["index"]):
                if rec.role != "param":
                    continue
                live = snapshots[s["iteration"]][prefix + rec.name]
                got = rank.tensor(rec)
                assert torch.equal(got.view(torch.int32), live.view(torch.int32))  # bitwise
                payload_ids.add(rec.payload)
                values.add(live.numpy().tobytes())
        assert len(payload_ids) == len(values)

    def test_statistics_match_torch(self, recorded):
        """Recorded min/max/mean/std/abs-max/norm equal torch's on the stored tensor."""
        _, rank, _ = recorded
        checked = 0
        for i in range(len(rank)):
            for rec in rank.tensor_records(i):
                t = rank.tensor(rec).double()
                s = rec.stats
                assert s["nan"] == 0 and s["inf"] == 0
                assert s["min"] == t.min().item() and s["max"] == t.max().item()
                assert s["absmax"] == t.abs().max().item()
                assert s["mean"] == pytest.approx(t.mean().item(), rel=1e-5, abs=1e-6)
                if t.numel() > 1:
                    assert s["std"] == pytest.approx(t.std().item(), rel=1e-4, abs=1e-6)
                assert s["norm"] == pytest.approx(t.norm().item(), rel=1e-5)
                checked += 1
        assert checked > 300


def test_a_module_steps_skeleton_holds_the_code_of_its_submodule_classes(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Each Block's skeleton holds, by class reference, the file, first line and source SHA-256 of the classes
    of its submodules that are the training code's own (Attention, MLP), not of torch's (LayerNorm, Linear,
    Dropout: the recorded versions say which) nor of Block itself (its definition holds that); each class's
    source is read once, however many modules of it the recording builds skeletons of."""
    from tests.models import MLP, Attention, Block, smooth_relu

    annotate = sys.modules["recorder.annotate"]  # (recorder.annotate is the function)

    for step in (Block, Attention, smooth_relu):  # (their definitions: read at their first call, here or before)
        step.__pdbg_step__.doc()
    annotate._CLASS_CODE.clear()
    read: list[object] = []
    code_info = annotate.code_info
    monkeypatch.setattr(annotate, "code_info", lambda target: (read.append(target), code_info(target))[1])
    record_training(tmp_path / "run.zarr", 2)
    rank = RunReader(tmp_path / "run.zarr").rank(0)
    expected = {f"tests.models:{cls.__qualname__}": {
        "file": inspect.getsourcefile(cls), "line": inspect.getsourcelines(cls)[1],
        "source_sha256": hashlib.sha256(inspect.getsource(cls).encode()).hexdigest()} for cls in (Attention, MLP)}
    modules = {(s["name"], s["path"]): rank.doc(int(rank.column("steps/module")[s["index"]])) for s in rows(rank)
               if s["phase"] == 0 and s["name"] != "smooth_relu"}
    assert set(modules) == {("Block", "h.0"), ("Block", "h.1"), ("Attention", "h.0.attn"), ("Attention", "h.1.attn")}
    for (name, _), doc in modules.items():
        assert doc.get("submodule_code") == (expected if name == "Block" else None), (name, doc.get("submodule_code"))
    assert read == [Attention, MLP]


def test_a_closed_recording_keeps_no_training_object_alive(tmp_path: Path) -> None:
    """A notebook keeps the Run after `with record(...) as run:`; deleting the model and the
    optimizer must free them (and the optimizer's state: on a GPU, its memory), in every mode.
    The closed Run held both until it was deleted itself."""
    for mode in ("stats", "full", "flight"):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        opt = torch.optim.Adam(model.parameters())
        with recorder.record(tmp_path / f"{mode}.zarr", model=model, optimizer=opt, mode=mode,
                             modules=["0", "2"]) as run:
            for _ in range(2):
                model(torch.randn(4, 8)).sum().backward()
                opt.step()
                opt.zero_grad()
        assert run.status == "complete"
        refs = [weakref.ref(model), weakref.ref(opt), weakref.ref(opt.state[model[0].weight]["exp_avg"])]
        del model, opt
        gc.collect()
        assert [r() is None for r in refs] == [True, True, True], mode


def test_a_second_recording_names_the_active_one(tmp_path: Path) -> None:
    """Recording again in a notebook while a recording opened without `with` still runs: the error
    names where that one records and how to close it, and the Run says what it is."""
    run = recorder.record(tmp_path / "first.zarr")
    try:
        assert repr(run) == f"<Run {tmp_path / 'first.zarr'}: recording, mode full>"
        with pytest.raises(recorder.RecordingError, match=r"already active in this process \(.*first\.zarr\); "
                                                         r"close it before starting another: run\.close\(\)"):
            recorder.record(tmp_path / "second.zarr")
    finally:
        run.close()
    assert repr(run) == f"<Run {tmp_path / 'first.zarr'}: complete, mode full>"


@pytest.mark.parametrize("mode", ["full", "flight"])
@pytest.mark.parametrize("ending", ["returns", "raises"])
def test_a_recording_left_open_is_closed_when_the_process_ends(tmp_path: Path, mode: str, ending: str) -> None:
    """A script (or notebook) that opens a recording without `with` and never closes it: when the process
    ends, the recording is closed with every step (three accumulated iterations, inside the writer's first
    second), its flight ring written, `complete`, or `crashed` with the exception that ended the process."""
    path = tmp_path / "run.zarr"
    code = textwrap.dedent(f"""
        import torch
        import recorder

        @recorder.paper_step("Eq. 1")
        def act(x):
            return torch.tanh(x)

        model = torch.nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        run = recorder.record({str(path)!r}, model=model, optimizer=opt, mode={mode!r})
        for _ in range(3):
            for _ in range(2):
                act(model(torch.ones(2, 4))).sum().div(2).backward()
            opt.step()
            opt.zero_grad()
        if {ending == "raises"}:
            raise ValueError("the data loader broke")
    """)
    proc = python("-c", code, cwd=ROOT)
    assert proc.returncode == (1 if ending == "raises" else 0), proc.stderr
    rec = replayer.open(path)
    assert len(rec) == 12 and [s.iteration for s in rec.steps][::4] == [0, 1, 2]
    if ending == "raises":
        assert rec.status == "crashed" and rec.rank.final["exception"]["message"] == "the data loader broke"
    else:
        assert rec.status == "complete" and "exception" not in rec.rank.final
    if mode == "flight":
        assert rec.rank.final["flight"]["dumps"][-1]["iterations"] == [1, 2]


@pytest.mark.parametrize("ending", ["exit(1)", "exit(0)", "caught exit(1)"])
def test_a_recording_left_open_by_a_failing_sys_exit_reads_crashed(tmp_path: Path, ending: str) -> None:
    """A script that leaves its recording open and ends with sys.exit(1) (a failed check, argparse's error): the
    recording read `complete`, as if the program had ended well (CPython keeps no trace of a SystemExit for its
    exit hooks); it is `crashed`, ended by SystemExit 1. sys.exit(0) is `complete`, and so is a sys.exit(1) whose
    SystemExit the program caught before it recorded on; sys.exit is the program's own again after the close."""
    path = tmp_path / "run.zarr"
    code = textwrap.dedent(f"""
        import sys
        import torch
        import recorder

        @recorder.paper_step("Eq. 1")
        def act(x):
            return torch.tanh(x)

        run = recorder.record({str(path)!r}, mode="stats")
        act(torch.ones(3))
        if {ending!r} == "caught exit(1)":
            try:
                sys.exit(1)
            except SystemExit:
                pass
            act(torch.ones(3))
        if {ending!r} == "exit(0)":
            sys.exit(0)
        if {ending!r} == "exit(1)":
            sys.exit(1)
    """)
    proc = python("-c", code, cwd=ROOT)
    assert proc.returncode == (1 if ending == "exit(1)" else 0), proc.stderr
    rec = replayer.open(path)
    if ending == "exit(1)":
        assert rec.status == "crashed" and rec.ended_by == "SystemExit: 1"
    else:
        assert rec.status == "complete" and "exception" not in rec.rank.final


def test_sys_exit_is_the_programs_own_after_the_recording_closes(tmp_path: Path) -> None:
    """While a recording is open sys.exit is watched; once it is closed, sys.exit is the program's own again."""
    before = sys.exit
    run = recorder.record(tmp_path / "run.zarr", mode="stats")
    try:
        assert sys.exit is not before
    finally:
        run.close()
    assert sys.exit is before and run.status == "complete"


def test_a_recording_is_entered_once(tmp_path: Path) -> None:
    """`with run:` again on a closed recording (a notebook cell run again), or inside its own `with` block
    (whose inner end would close it), is refused: the block would train unrecorded, and nothing said so."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    run = recorder.record(tmp_path / "closed.zarr", model=model, modules=["*"])
    with run:
        model(torch.ones(2, 4))
    with pytest.raises(recorder.RecordingError) as err:
        with run:
            model(torch.ones(2, 4))
    assert str(err.value) == (f"the recording {tmp_path / 'closed.zarr'} is closed (complete); a recording is "
                              "entered once: start a new one, recorder.record(NEW_PATH, ...)")
    run = recorder.record(tmp_path / "nested.zarr", model=model, modules=["*"])
    with pytest.raises(recorder.RecordingError, match=r"nested\.zarr is in its `with` block already; enter it once"):
        with run:
            model(torch.ones(2, 4))
            with run:
                model(torch.ones(2, 4))
    assert run.status == "crashed"
    assert len(replayer.open(tmp_path / "closed.zarr")) == len(replayer.open(tmp_path / "nested.zarr")) == 2


def test_a_recording_out_of_reach_is_closed_by_recorder_close(tmp_path: Path) -> None:
    """A notebook's `recorder.record(...)` run as a statement keeps no Run to close, and every later recording
    was refused until the kernel restarted: the refusal names recorder.close(), which closes it complete."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    recorder.record(tmp_path / "lost.zarr", model=model, modules=["*"])
    model(torch.ones(2, 4))
    gc.collect()
    with pytest.raises(recorder.RecordingError, match=r"lost\.zarr\); .* or recorder\.close\(\) where that Run is "
                                                      r"out of reach$"):
        recorder.record(tmp_path / "next.zarr", model=model, modules=["*"])
    assert recorder.close() is True and recorder.close() is False
    lost = replayer.open(tmp_path / "lost.zarr")
    assert lost.status == "complete" and len(lost) == 2
    with recorder.record(tmp_path / "next.zarr", model=model, modules=["*"]) as run:
        model(torch.ones(2, 4))
    assert run.status == "complete" and len(replayer.open(tmp_path / "next.zarr")) == 2


def test_recorder_close_after_a_stop_closes_crashed(tmp_path: Path) -> None:
    """A notebook's training cell stopped by on_anomaly="stop", its recording left open: recorder.close() closed it
    `complete`, where the end of the kernel would have closed it `crashed` with the stop."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    recorder.record(tmp_path / "stopped.zarr", model=model, modules=["*"], on_anomaly="stop")
    with pytest.raises(recorder.NonFiniteError):
        model(torch.full((2, 4), torch.inf))
    assert recorder.close() is True
    rec = replayer.open(tmp_path / "stopped.zarr")
    assert rec.status == "crashed" and rec.ended_by.startswith("NonFiniteError: "), rec.ended_by


KERNEL = textwrap.dedent('''
    import sys, types

    class Events:
        """IPython's EventManager, as a Jupyter kernel's shell has it."""
        def __init__(self):
            self.callbacks = {"pre_run_cell": [], "post_run_cell": []}
        def register(self, event, function):
            self.callbacks[event].append(function)
        def unregister(self, event, function):
            self.callbacks[event].remove(function)

    class Shell:
        """A kernel's shell: a cell's exception is shown and kept in sys.last_value; the process goes on."""
        def __init__(self):
            self.events = Events()
        def run_cell(self, code):
            for f in self.events.callbacks["pre_run_cell"][:]:
                f(None)
            result = types.SimpleNamespace(error_in_exec=None)
            try:
                exec(code, globals())
            except Exception as exc:
                result.error_in_exec = sys.last_value = exc
            for f in self.events.callbacks["post_run_cell"][:]:
                f(result)

    shell = Shell()
    sys.modules["IPython"] = types.SimpleNamespace(get_ipython=lambda: shell)
''')

TRAINING_CELL = textwrap.dedent('''
    import torch
    import recorder

    @recorder.paper_step("Eq. 1")
    def act(x):
        return torch.tanh(x)

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recorder.record(PATH, model=model, optimizer=opt)
    for it in range(3):
        if it == BREAKS_AT:
            raise ValueError("the data loader broke")
        act(model(torch.ones(2, 4))).sum().backward()
        opt.step()
        opt.zero_grad()
''')


@pytest.mark.parametrize(("cells", "ended_by"), [
    (["undefined_name_typo", "TRAIN"], None),  # a typo fixed before training
    (["TRAIN", "replayer_typo.open(PATH)"], None),  # a typo after it
    (["TRAIN", "BREAKS_AT = None", "TRAIN_AGAIN"], None),  # the training cell fixed and run again
    (["TRAIN", "print('plotting')"], "the data loader broke"),  # the training cell's own
    (["TRAIN", "recorder.close()", "typo_after_closing"], "the data loader broke"),  # closed by hand: the same
    (["SCRIPT"], "the data loader broke"),  # `ipython train.py`: no cell, the script's traceback shown
])
def test_a_notebook_recording_left_open_ends_with_its_training_cells_exception(
        tmp_path: Path, cells: list[str], ended_by: str | None) -> None:
    """In a Jupyter kernel every exception a cell shows is in sys.last_value, and the process ends of none: a
    recording left open (`recorder.record(...)` as a statement) closed `crashed` with a typo's NameError from
    any cell, one before the recording too. It is `crashed` with the exception of the last cell that recorded
    steps of it, `complete` where that cell finished."""
    path = tmp_path / "run.zarr"
    breaks = 1 if ended_by or "TRAIN_AGAIN" in cells else None
    again = TRAINING_CELL.replace("recorder.record(PATH, model=model, optimizer=opt)", "")
    script = f"try:\n    exec({TRAINING_CELL!r})\nexcept Exception as exc:\n    sys.last_value = exc\n"
    code = KERNEL + f"PATH, BREAKS_AT = {str(path)!r}, {breaks!r}\n" + "".join(
        script if c == "SCRIPT" else
        f"shell.run_cell({(TRAINING_CELL if c == 'TRAIN' else again if c == 'TRAIN_AGAIN' else c)!r})\n"
        for c in cells)
    proc = python("-c", code, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    rec = replayer.open(path)
    if ended_by is None:
        assert rec.status == "complete" and "exception" not in rec.rank.final, rec.ended_by
    else:
        assert rec.status == "crashed" and rec.rank.final["exception"]["message"] == ended_by


@pytest.mark.parametrize(("names", "env", "said"), [
    ({"__session__": "analysis/train.ipynb"}, {}, "notebook analysis/train.ipynb"),  # Jupyter, via ipykernel
    ({}, {"JPY_SESSION_NAME": "/home/u/train.ipynb"}, "notebook /home/u/train.ipynb"),  # an older ipykernel
    ({"__vsc_ipynb_file__": "/w/nb.ipynb"}, {}, "notebook /w/nb.ipynb"),  # VS Code
    ({}, {}, "a Jupyter kernel (its notebook not named)"),
])
def test_a_notebook_recording_names_its_notebook(tmp_path: Path, names: dict[str, str], env: dict[str, str],
                                                 said: str) -> None:
    """A kernel's argv is ipykernel's launcher and its connection file (`ipykernel_launcher.py -f
    .../kernel-7f3.json`), which `pdbg info` showed as what ran the recording: it names the notebook."""
    path = tmp_path / "run.zarr"
    code = textwrap.dedent(f'''
        import sys, types
        sys.argv = ["/venv/lib/python3.11/site-packages/ipykernel_launcher.py", "-f", "/run/kernel-7f3.json"]
        shell = types.SimpleNamespace(kernel=object(), user_ns={names!r})
        sys.modules["IPython"] = types.SimpleNamespace(get_ipython=lambda: shell)
        import torch, recorder
        model = torch.nn.Linear(2, 2)
        with recorder.record({str(path)!r}, model=model, modules=["**"]):
            model(torch.ones(1, 2))
    ''')
    proc = subprocess.run([sys.executable, "-c", code], check=False, cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **env, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert replayer.open(path).run_info["notebook"] == said.removeprefix("notebook ").replace(
        "a Jupyter kernel (its notebook not named)", "")
    info = pdbg("info", str(path), cwd=tmp_path)
    assert info.returncode == 0, info.stderr
    line = next(x for x in info.stdout.splitlines() if x.startswith("recorded "))
    assert f": {said} (torch" in line and "kernel-7f3" not in line


def test_a_script_recording_names_no_notebook(tmp_path: Path) -> None:
    """Outside a kernel (a terminal IPython, a script) `notebook` is null and `pdbg info` shows the command line."""
    path = tmp_path / "run.zarr"
    model = torch.nn.Linear(2, 2)
    with recorder.record(path, model=model, modules=["**"]):
        model(torch.ones(1, 2))
    assert replayer.open(path).run_info["notebook"] is None
