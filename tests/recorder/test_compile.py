"""Recording a model under torch.compile: the recorder's hooks and step wrappers leave the graph
(a graph break at each recorded step, which runs eagerly), so training is not broken and the
recording is the one the same model makes uncompiled, wherever torch.compile is applied."""

from __future__ import annotations

import sys
import types
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import recorder
import replayer
from tests.cli import ROOT, python
from tests.models import TinyGPT, train_step
from tests.recorder.readback import raw, step_rows

ITERATIONS = 3


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch and leaves no compiled code behind."""
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def record_gpt(path, compile_: Callable[[nn.Module], nn.Module] | None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run_model = compile_(model) if compile_ else model
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with recorder.record(path, model=model, optimizer=opt, mode="full") as run:
            losses = [train_step(run_model, opt, i) for i in range(ITERATIONS)]
    assert run.status == "complete" and run.failure is None
    assert not [w for w in caught if issubclass(w.category, recorder.RecorderWarning)]
    return losses + [p.detach().clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def eager_gpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("eager") / "run.zarr"
    return record_gpt(path, None), step_rows(path)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_compiled_model_records_as_the_same_model_uncompiled(eager_gpt, tmp_path, backend):
    """Paper steps inside torch.compile: every call and backward recorded with its module path and
    parent, every tensor bit-identical to the uncompiled recording; training as without recording."""
    want_results, want_steps = eager_gpt
    path = tmp_path / "run.zarr"
    results = record_gpt(path, lambda m: torch.compile(m, backend=backend))
    assert step_rows(path) == want_steps
    assert len(want_steps) == ITERATIONS * 12
    for got, want in zip(results, want_results, strict=True):
        assert raw(got) == raw(want)


@pytest.mark.slow
def test_a_model_compiled_by_inductor_records_its_steps_and_they_replay(eager_gpt, tmp_path):
    """With inductor the code between steps is compiled kernels: the steps are the uncompiled
    model's, and each forward step (run eagerly while recording) replays bit for bit."""
    _, want_steps = eager_gpt
    path = tmp_path / "run.zarr"
    record_gpt(path, torch.compile)
    got = step_rows(path)
    assert [{k: v for k, v in s.items() if k != "tensors"} for s in got] == \
        [{k: v for k, v in s.items() if k != "tensors"} for s in want_steps]
    rec = replayer.open(path)
    for step in rec.steps.filter(phase="forward", iteration=1):
        assert replayer.replay(rec, step.index).match, step


class Plain(nn.Module):
    """No decorators: recorded through module-path globs."""

    def __init__(self, checkpointed: str | None = None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)])
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.checkpointed is None:
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.checkpointed == "reentrant")
        return x.sum()


def compiled_recorder_code() -> list[str]:
    """The recorder's functions (methods and nested functions included) Dynamo holds compiled code for."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    pending = [v for name, mod in list(sys.modules.items())
               if name == "recorder" or name.startswith("recorder.") for v in vars(mod).values()]
    seen: set[int] = set()
    found = []
    while pending:
        obj = pending.pop()
        obj = getattr(obj, "__func__", obj)
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, type) and obj.__module__.startswith("recorder"):
            pending.extend(vars(obj).values())
        elif isinstance(obj, types.FunctionType):
            pending.append(obj.__code__)
        elif isinstance(obj, types.CodeType) and obj.co_filename.startswith(str(ROOT / "recorder")):
            pending.extend(c for c in obj.co_consts if isinstance(c, types.CodeType))
            if _debug_get_cache_entry_list(obj):
                found.append(f"{obj.co_filename}:{obj.co_firstlineno} {obj.co_name}")
    return found


def record_plain(path, where: str | None, checkpointed: str | None = None, input_grad: bool = False) -> list[dict]:
    torch.manual_seed(0)
    model = Plain(checkpointed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    forward: Callable[[torch.Tensor], torch.Tensor] = model
    if where == "model":
        forward = torch.compile(model, backend="eager")
    elif where == "blocks":
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, backend="eager")

    def train(x: torch.Tensor) -> torch.Tensor:
        loss = forward(x)
        loss.backward()
        return loss

    def whole_step(x: torch.Tensor) -> torch.Tensor:  # the optimizer's step inside the compiled code too
        loss = train(x)
        opt.step()
        opt.zero_grad()
        return loss

    if where == "training function":
        train = torch.compile(train, backend="eager")
    if where == "training step":
        whole_step = torch.compile(whole_step, backend="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's note that global hooks also see the compile wrapper
        with recorder.record(path, model=model, optimizer=opt, mode="full", modules=["blocks.*"]) as run:
            for i in range(ITERATIONS):
                whole_step(torch.randn(4, 8, generator=torch.Generator().manual_seed(i)).requires_grad_(input_grad))
    assert run.status == "complete" and run.failure is None
    assert not [m for m in model.modules() if "_paperdebugger_selected" in m.__dict__]  # marks removed
    assert compiled_recorder_code() == []  # the recorder's own code ran eagerly, never compiled
    return step_rows(path)


@pytest.mark.parametrize("where", ["model", "blocks", "training function", "training step"])
def test_modules_selected_by_glob_inside_compiled_code(tmp_path, where):
    """`modules=["blocks.*"]` on a compiled model, on compiled blocks, in a compiled training
    function, or a compiled training step (the optimizer's step and the backward inside; the code
    torch.compile rewrites around a graph break can hold unhashable constants): the same steps as
    uncompiled (the compile wrapper is not a step of its own), with the
    paths of the model as written, bit-identical tensors."""
    want = record_plain(tmp_path / "plain.zarr", None)
    assert [(s["path"], s["phase"]) for s in want[:6]] == [("blocks.0", 0), ("blocks.1", 0), ("blocks.2", 0),
                                                         ("blocks.2", 1), ("blocks.1", 1), ("blocks.0", 1)]
    assert record_plain(tmp_path / "compiled.zarr", where) == want


@pytest.mark.parametrize("where", ["training function", "training step"])
@pytest.mark.parametrize("checkpointed", ["reentrant", "non-reentrant"])
def test_modules_selected_by_glob_in_compiled_code_under_checkpointing(tmp_path, where, checkpointed):
    """A compiled training function over checkpointed blocks: the model's own call runs inside the
    compiled code (no hook sees it), the blocks' calls outside it. Their paths are still the
    model's (not relative to the block, which the glob then matched nothing of), the steps are
    those of the model uncompiled, and each one, forward and backward, replays bit for bit."""
    input_grad = checkpointed == "reentrant"  # reentrant checkpointing needs an input requiring grad
    want = record_plain(tmp_path / "plain.zarr", None, input_grad=input_grad)
    path = tmp_path / "compiled.zarr"
    assert record_plain(path, where, checkpointed, input_grad=input_grad) == want
    rec = replayer.open(path)
    assert len(rec.steps) == ITERATIONS * 6
    for step in rec.steps:
        result = replayer.replay(rec, step.index)
        assert result.match, (step.selector, [d.summary() for d in result.outputs if not d.match])


def test_recording_does_not_import_dynamo():
    """torch._dynamo takes seconds to import: neither `import recorder` nor a recording with its
    forward and backward steps loads it (torch's optimizers do, on their own)."""
    code = ("import sys, tempfile, recorder\n"
            "from tests.models import TinyGPT, batch\n"
            "model = TinyGPT()\n"
            "with recorder.record(tempfile.mkdtemp() + '/run.zarr', model=model) as run:\n"
            "    for i in range(2):\n"
            "        model(batch(i)[0]).sum().backward()\n"
            "        run.next_iteration()\n"
            "assert run.steps == 24, run.steps\n"
            "print('torch._dynamo' in sys.modules)\n")
    done = python("-c", code, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_code_with_unhashable_constants_on_the_stack_is_walked_past():
    """torch.compile rewrites code around a graph break into code objects that can hold dicts among
    their constants (so they cannot be hashed); finding activation checkpointing on the stack walks
    past them instead of failing (which stopped the recording: "unhashable type: 'dict'")."""
    from recorder import capture

    def probe() -> bool:
        return capture.in_checkpointing(1)

    rewritten = probe.__code__.replace(co_consts=(*probe.__code__.co_consts, {"resume": 1}))
    with pytest.raises(TypeError):
        hash(rewritten)
    probe.__code__ = rewritten
    assert probe() is False


@pytest.mark.slow
def test_modules_selected_in_an_inductor_compiled_model_run_eagerly_and_replay(tmp_path):
    """A GPT-2 compiled with inductor (Hugging Face's torch_compile=True), its layers chosen by a
    glob: the layers ran compiled while their calls were recorded, and no step replayed bit for bit
    (0 of 12). Their forward now runs eagerly while recording: every step replays bit for bit, and
    the modules are as they were after the recording closes. The eager forward is the class's while
    recording, not an attribute of the module: a deep copy made meanwhile (an EMA teacher) runs its
    own weights, and the model still saves."""
    import copy
    import io

    import transformers

    block_class = transformers.models.gpt2.modeling_gpt2.GPT2Block
    original = block_class.__dict__["forward"]
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, use_cache=False,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    compiled = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "run.zarr"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with recorder.record(path, model=model, optimizer=opt, mode="full", modules=["transformer.h.*"]):
            for i in range(3):
                ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(i))
                compiled(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()
                teacher = copy.deepcopy(model)
                assert teacher.transformer.h[0].forward.__self__ is teacher.transformer.h[0]
                torch.save(model, io.BytesIO())
    assert not [m for m in model.modules() if "forward" in m.__dict__ or "_paperdebugger_selected" in m.__dict__]
    assert block_class.__dict__["forward"] is original
    rec = replayer.open(path)
    assert len(rec.steps) == 12
    for step in rec.steps:
        result = replayer.replay(rec, step.index)
        assert result.match, (step.selector, [d.summary() for d in result.outputs if not d.match])


def train_fullgraph(path, model: nn.Module, recorded: bool, modules: list[str] | None = None,
                    ) -> tuple[list[torch.Tensor], int, list[str]]:
    """Three iterations of ``model`` compiled with fullgraph=True (recorded into ``path`` or not): the
    losses and parameters, the graphs Dynamo compiled, and the RecorderWarnings."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    forward = torch.compile(model, backend="eager", fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with recorder.record(path, model=model, optimizer=opt, mode="full", modules=modules) if recorded \
                else warnings.catch_warnings():
            losses = [train_step(forward, opt, i) for i in range(ITERATIONS)]
    said = [str(w.message) for w in caught if issubclass(w.category, recorder.RecorderWarning)]
    return losses + [p.detach().clone() for p in model.parameters()], counters["stats"]["unique_graphs"], said


class PlainLM(nn.Module):
    """Plain's blocks over TinyGPT's batches: no decorated step, recorded through a glob."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.blocks = Plain().blocks
        self.head = nn.Linear(8, 32)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("selected", ["decorated", "glob"])
def test_a_model_compiled_with_fullgraph_trains_as_unrecorded_and_says_its_steps_are_not_recorded(tmp_path, selected):
    """torch.compile(model, fullgraph=True): the recorder's graph break at each step raised (Dynamo's
    Unsupported) and ended the training. The steps now stay in the one graph, unrecorded, and a
    RecorderWarning names them: training bit for bit as without recording, with the same graphs."""
    make, modules, named = (TinyGPT, None, "paper step 'Attention'") if selected == "decorated" else \
        (PlainLM, ["blocks.*"], "module Sequential")
    torch.manual_seed(0)
    want, want_graphs, _ = train_fullgraph(None, make(), recorded=False)
    torch.manual_seed(0)
    got, graphs, said = train_fullgraph(tmp_path / "run.zarr", make(), recorded=True, modules=modules)
    for a, b in zip(got, want, strict=True):
        assert raw(a) == raw(b)
    assert graphs == want_graphs == 1
    assert any(s.startswith(named) and "fullgraph=True" in s and "not recorded" in s for s in said), said
    if modules:  # the glob matched modules it could not see called: the warning that it matched none says why
        assert all("fullgraph=True are not recorded" in s for s in said if "matched no module" in s), said
        assert any("matched no module" in s for s in said), said
