"""Marking steps: decorated classes and functions, annotated instances, and what their definitions
record (paper reference, import reference, source and its hash, constructor arguments)."""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import os
import sys

import pytest
import torch
import torch.nn as nn

import recorder
from recorder.store.reader import RunReader
from tests.models import Attention, smooth_relu


def _step(rank, i):
    col = lambda n: rank.column(f"steps/{n}")[i]  # noqa: E731
    return {"name": rank.doc(int(col("name"))), "definition": rank.doc(int(col("definition"))),
            "module": rank.doc(int(col("module"))), "path": rank.doc(int(col("module_path"))),
            "settings": rank.doc(int(col("settings"))), "phase": int(col("phase"))}


def test_decorated_class_records_definition_and_constructor_arguments(run_path):
    """A decorated class's steps carry its paper reference, code and the arguments it was built with."""
    attn = Attention(8, heads=2, dropout=0.0)
    with recorder.record(run_path):
        attn(torch.randn(1, 4, 8))
    step = _step(RunReader(run_path).rank(0), 0)
    d = step["definition"]
    assert d["name"] == "Attention" and d["kind"] == "module"
    assert d["paper"] == {"label": "Eq. 1", "algorithm": "Algorithm 1", "step": 3, "equation": None,
                          "description": "causal self-attention"}
    assert d["ref"] == "tests.models:Attention"
    source = inspect.getsource(Attention)
    assert d["source"] == source and d["source_sha256"] == hashlib.sha256(source.encode()).hexdigest()
    assert d["file"].endswith("tests/models.py") and d["line"] == inspect.getsourcelines(Attention)[1]
    assert step["module"]["class"] == "tests.models:Attention"
    assert step["module"]["init"]["args"] == [8] and step["module"]["init"]["kwargs"] == {"heads": 2, "dropout": 0.0}


def test_decorated_function_definition(run_path):
    """A decorated function's name defaults to its qualified name; its module field is empty."""
    with recorder.record(run_path):
        smooth_relu(torch.zeros(2))
    step = _step(RunReader(run_path).rank(0), 0)
    assert step["name"] == "smooth_relu" and step["definition"]["kind"] == "function"
    assert step["definition"]["ref"] == "tests.models:smooth_relu"
    assert step["module"] is None and step["path"] == ""


@contextlib.contextmanager
def _quiet():  # a decorator of the standard library's (contextlib.py), made with functools.wraps
    yield


@recorder.paper_step("Eq. 4", description="SGD with momentum")
@torch.no_grad()
def _sgd_update(param, grad, buf, lr, momentum):
    buf.mul_(momentum).add_(grad)
    param.add_(buf, alpha=-lr)


@recorder.paper_step("Eq. 5")
@torch.enable_grad()
def _doubled(x):
    return x * 2


@recorder.paper_step("Eq. 6")
@torch.inference_mode()
def _tripled(x):
    return x * 3


@recorder.paper_step("Eq. 7")
@_quiet()
def _quadrupled(x):
    return x * 4


@torch.no_grad()
@recorder.paper_step("Eq. 8")
def _halved(x):
    return x / 2


def test_a_step_under_a_wrapping_decorator_records_the_file_its_code_is_in(run_path):
    """``@paper_step`` above ``@torch.no_grad()`` (the usual way to write an optimizer update), and above
    ``@torch.enable_grad()``, ``@torch.inference_mode()`` or another ``functools.wraps`` decorator: the
    step's source and line were the user's function's, its file torch's ``utils/_contextlib.py`` (or
    the decorator's), so the TUI showed torch's file, the code-drift check named it, and a bundle of a
    step in a project module carried no source. Now the file is the one the source comes from, as
    with the decorator below ``@paper_step``."""
    steps = (_sgd_update, _doubled, _tripled, _quadrupled, _halved)
    with recorder.record(run_path):
        p = torch.ones(4, requires_grad=True)
        _sgd_update(p, torch.full((4,), 0.5), torch.zeros(4), 0.1, 0.9)
        x = torch.ones(3, requires_grad=True)
        _doubled(x), _tripled(x), _quadrupled(x), _halved(x)
    rank = RunReader(run_path).rank(0)
    for i, fn in enumerate(steps):
        d = _step(rank, i)["definition"]
        lines, line = inspect.getsourcelines(fn)
        assert d["file"] == os.path.abspath(__file__) and d["line"] == line, (fn, d["file"], d["line"])
        assert d["source"] == "".join(lines) and d["ref"] == f"{__name__}:{fn.__name__}"


def test_a_library_function_patched_into_a_step_is_said_once_and_a_factory_of_another_file_is_not(
        run_path, tmp_path, monkeypatch):
    """A library's function made a paper step at run time (``F.softsign = paper_step(...)(F.softsign)``, in a
    function) recorded without a word, and a replay, which imports torch.nn.functional, finds it undecorated:
    said once, when the recording first meets it. A step decorated through a factory another file defines
    (``@marked("Eq. 2")``, which calls paper_step there) is its module's own, and is not said."""
    import importlib
    import re
    import warnings

    import torch.nn.functional as F

    from recorder import capture

    (tmp_path / "stepfactory.py").write_text("import recorder\n\n\ndef marked(label):\n    def deco(fn):\n"
                                             "        return recorder.paper_step(label)(fn)\n    return deco\n")
    (tmp_path / "stepuser.py").write_text("from stepfactory import marked\n\n\n@marked('Eq. 2')\ndef halve(x):\n"
                                          "    return x / 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        user = importlib.import_module("stepuser")
        monkeypatch.setattr(F, "softsign", recorder.paper_step("Eq. 3")(F.softsign))
        with warnings.catch_warnings(record=True) as caught, recorder.record(run_path):
            warnings.simplefilter("always")
            for _ in range(2):
                user.halve(torch.ones(2)), F.softsign(torch.ones(2))
    finally:
        for name in ("stepuser", "stepfactory"):
            sys.modules.pop(name, None)
    said = [str(c.message) for c in caught if issubclass(c.category, capture.RecorderWarning)]
    assert len(said) == 1 and re.fullmatch(
        re.escape("PaperDebugger: step softsign (Eq. 3) is recorded, but it is a paper step made at run time: "
                  f"paper_step was called on torch.nn.functional.softsign at {__file__}:") + r"\d+" + re.escape(
            ", outside the code that defines it (a patch of a library's function), and a replay imports "
            "torch.nn.functional and finds the undecorated function there; decorate a function defined at the top "
            "level of your own code that calls it, and patch that in, or make the patch at the top level of the "
            "training script, outside `if __name__ == \"__main__\":` (a replay loads that)"), said[0]), said


def test_settings_snapshot_holds_threads_and_cpu_capability(run_path):
    """Each step's settings say how many threads ran it and on which CPU capability."""
    torch.set_num_threads(1)
    with recorder.record(run_path):
        smooth_relu(torch.zeros(2))
    settings = _step(RunReader(run_path).rank(0), 0)["settings"]
    assert settings["num_threads"] == 1
    assert settings["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert settings["deterministic_algorithms"] is False and settings["grad_enabled"] is True


def test_settings_snapshot_names_the_default_device_a_block_or_a_setting_gives():
    """The settings' default device is torch's, inside a ``with torch.device(...)`` block and under
    ``torch.set_default_device`` as outside them (read without torch's getter where neither is in force)."""
    from recorder import snapshot

    assert snapshot.settings()["default_device"] == str(torch.get_default_device()) == "cpu"
    with torch.device("meta"):
        assert snapshot.settings()["default_device"] == "meta"
    torch.set_default_device("meta")
    try:
        assert snapshot.settings()["default_device"] == "meta"
    finally:
        torch.set_default_device(None)
    assert snapshot.settings()["default_device"] == "cpu"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(4)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(self.norm(x))


def test_annotated_instance_is_recorded_with_params_and_buffers(run_path):
    """annotate() on a library module records its calls, parameters, buffers and backward."""
    net = Net()
    recorder.annotate(net.norm, "Eq. 4", description="batch statistics")
    recorder.annotate(net.fc, "Eq. 5", name="classifier")
    with recorder.record(run_path, model=net):
        net(torch.randn(3, 4)).sum().backward()
    rank = RunReader(run_path).rank(0)
    steps = [_step(rank, i) for i in range(len(rank))]
    assert [(s["name"], s["path"], s["phase"]) for s in steps] == [
        ("BatchNorm1d", "norm", 0), ("classifier", "fc", 0), ("classifier", "fc", 1), ("BatchNorm1d", "norm", 1)]
    roles = {(r.role, r.name) for r in rank.tensor_records(0)}
    assert {("param", "weight"), ("buffer", "running_mean"), ("buffer", "num_batches_tracked")} <= roles
    assert steps[1]["definition"]["paper"]["label"] == "Eq. 5"
    norm = steps[0]["module"]
    assert norm["class"] == "torch.nn.modules.batchnorm:BatchNorm1d" and norm["init"] is None
    assert norm["attrs"]["num_features"] == 4 and norm["attrs"]["momentum"] == 0.1
    assert norm["params"] == {"weight": {"requires_grad": True}, "bias": {"requires_grad": True}}
    assert set(norm["buffers"]) == {"running_mean", "running_var", "num_batches_tracked"}


def test_marking_outside_a_recording_changes_nothing():
    """Decorated and annotated steps compute exactly what the plain code computes."""
    lin = nn.Linear(3, 3)
    x = torch.randn(2, 3)
    expected = lin(x)
    recorder.annotate(lin, "Eq. 9")
    assert torch.equal(lin(x), expected)
    assert torch.equal(smooth_relu(x), torch.log1p(torch.exp(x + 1.0)))


def test_bad_marks_are_refused():
    """A missing label, or marking something that is not a step, is a clear TypeError."""
    with pytest.raises(TypeError, match="label"):
        recorder.paper_step(description="no label")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="label as a non-empty string"):
        recorder.paper_step("")
    with pytest.raises(TypeError, match="nn.Module instance"):
        recorder.annotate(smooth_relu, "Eq. 2")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="decorates functions and nn.Module classes"):
        recorder.paper_step("Eq. 1")(42)


def test_a_blank_label_is_refused_and_annotate_says_annotate():
    """paper_step("   ") was accepted, and no selector could name its steps ("invalid step selector '   '");
    annotate's refusals said "paper_step's label". Both are one-line errors that name the function given it."""
    for blank in ("   ", "\u3000"):
        with pytest.raises(ValueError, match=r"^paper_step's label '.+' is blank; give it as the paper writes it"):
            recorder.paper_step(blank)
    with pytest.raises(ValueError, match="^paper_step's name ' ' is blank"):
        recorder.paper_step("Eq. 1", name=" ")
    with pytest.raises(ValueError, match=r"^annotate's label 'a\\nb' holds a control character"):
        recorder.annotate(nn.Linear(2, 2), "a\nb")
    with pytest.raises(ValueError, match=r"^annotate's label ' ' is blank; give it as the paper writes it, e\.g\. "
                                         r"annotate\(module, 'Eq\. 2'\)"):
        recorder.annotate(nn.Linear(2, 2), " ")
    with pytest.raises(TypeError, match="^annotate needs the paper's label as a non-empty string after the module"):
        recorder.annotate(nn.Linear(2, 2), "")
    assert recorder.paper_step(" Eq. 2 ") is not None  # (text around it: selected as written)


def test_what_a_function_step_cannot_be_is_refused_when_decorated():
    """A generator's body runs after the call returned (the step recorded nothing, and a NaN it made
    was found nowhere); a functools.partial has no definition to find again (its decoration raised
    AttributeError: __qualname__, or, named, its replay looked for "functools.partial(...)")."""
    import functools

    def draws(n):
        yield from range(n)

    async def later(x):
        return x

    def scaled(x, s):
        return x * s

    with pytest.raises(TypeError, match=r"draws: it is a generator function, whose body runs after the call has "
                                        r"returned"):
        recorder.paper_step("Eq. 1")(draws)
    with pytest.raises(TypeError, match="it is a coroutine function"):
        recorder.paper_step("Eq. 1")(later)
    for name in (None, "half"):
        with pytest.raises(TypeError, match=r"cannot decorate functools.partial\(.*scaled, \.\.\.\): a partial has "
                                            r"no definition of its own to replay; decorate the function it wraps"):
            recorder.paper_step("Eq. 1", name=name)(functools.partial(scaled, s=0.5))
    # a module whose forward yields (a sampler yielding each refinement) is refused alike: it was accepted, and
    # its replay compared only the generator's type ("MATCH: bit for bit")

    class Sampler(nn.Module):
        def forward(self, x):
            yield x * 2

    refused = (r"paper_step cannot record test_what_a_function_step_cannot_be_is_refused_when_decorated\.<locals>\."
               r"Sampler\.forward: it is a generator function, whose body runs after the call has returned")
    with pytest.raises(TypeError, match=refused):
        recorder.paper_step("Algorithm 3")(Sampler)
    with pytest.raises(TypeError, match=refused):
        recorder.annotate(Sampler(), "Algorithm 3")


class _RoundSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def test_a_custom_autograd_function_or_its_apply_is_refused_when_decorated():
    """A custom autograd.Function decorated was made a function (its apply gone: the training code raised
    AttributeError, recording or not); its apply decorated was recorded as a step named Function.apply (every
    Function's apply is torch's one function) that no replay could find. Both are refused with what to decorate,
    and the class stays as it was."""
    with pytest.raises(TypeError, match=r"^paper_step cannot decorate _RoundSTE: it is a torch.autograd.Function, not "
                                        r"a function or an nn.Module class; decorate a function that calls "
                                        r"_RoundSTE\.apply\(\.\.\.\)$"):
        recorder.paper_step("Eq. 1")(_RoundSTE)
    with pytest.raises(TypeError, match=r"^paper_step cannot decorate _RoundSTE.apply: it is torch's Function.apply "
                                        r"bound to _RoundSTE .*; decorate a function that calls _RoundSTE\.apply"):
        recorder.paper_step("Eq. 1")(_RoundSTE.apply)
    x = torch.tensor([0.4, 1.6], requires_grad=True)
    _RoundSTE.apply(x).sum().backward()
    assert torch.equal(x.grad, torch.ones(2))


@torch.library.custom_op("pdbg_annotate::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_an_operator_custom_op_made_is_refused_with_what_to_decorate():
    """@paper_step over @torch.library.custom_op was refused as "not CustomOpDef objects", naming torch's class
    and no way to record the operator. The refusal names the operator and the two ways that work."""
    with pytest.raises(TypeError, match=r"^paper_step cannot decorate the operator pdbg_annotate::twice that "
                                        r"torch.library.custom_op made .*; decorate a def that calls it .*, or put "
                                        r"@recorder.paper_step under @torch.library.custom_op$"):
        recorder.paper_step("Eq. 1")(_twice)
    assert torch.equal(_twice(torch.ones(2)), torch.full((2,), 2.0))


def test_two_threads_calling_new_steps_find_their_sources_one_at_a_time(run_path, monkeypatch):
    """Two training threads calling steps for the first time at once parsed source files at once,
    and CPython 3.11's parser raised "AST constructor recursion depth mismatch": the recording
    stopped for the rest of the run. The sources are found one thread at a time now."""
    import importlib
    import threading

    import replayer

    annotate = importlib.import_module("recorder.annotate")
    real, held = annotate.code_info, []

    def code_info(target):
        held.append(annotate._SOURCE_LOCK.locked())
        return real(target)

    monkeypatch.setattr(annotate, "code_info", code_info)
    steps = [recorder.paper_step(f"Eq. {k}")(lambda x, k=k: x * k) for k in range(8)]
    with recorder.record(run_path) as run:
        threads = [threading.Thread(target=step, args=(torch.ones(2),)) for step in steps]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert held == [True] * 8 and run.status == "complete"
    assert len(replayer.open(run_path)) == 8


@recorder.paper_step("Eq. 1", description="a base layer")
class _BaseLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


@recorder.paper_step("Eq. 2", description="the paper's variant of the base layer, its forward inherited")
class _VariantLayer(_BaseLayer):
    pass


def test_a_step_class_inheriting_a_step_classs_forward_is_one_step_a_call(tmp_path) -> None:
    """A step class whose forward is inherited from a class that is a step too: a call of it was recorded
    twice, as itself and, inside, as its base (bisect named the base, the innermost). It is one step a call,
    its own, which replays forward and backward; the base class's own instances stay steps of the base's."""
    import replayer

    torch.manual_seed(0)
    model = nn.Sequential(_VariantLayer(), _BaseLayer())
    path = tmp_path / "run.zarr"
    with recorder.record(path, model=model):
        model(torch.randn(3, 4)).sum().backward()
    with replayer.open(path) as rec:
        assert [(s.name, s.module_path, s.phase) for s in rec.steps] == [
            ("_VariantLayer", "0", "forward"), ("_BaseLayer", "1", "forward"),
            ("_BaseLayer", "1", "backward"), ("_VariantLayer", "0", "backward")]
        for step in rec.steps:
            result = replayer.replay(rec, step.index)
            assert result.match and result.compared, (step.index, [d.summary() for d in result.outputs])
