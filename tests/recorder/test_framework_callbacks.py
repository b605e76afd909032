"""The PyTorch Lightning and Hugging Face callbacks (recorder.lightning, recorder.huggingface) and
what they share (recorder.framework, Run.pause/paused/paths_relative_to/notify_nonfinite)."""

from __future__ import annotations

import signal
import textwrap
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import recorder
import replayer
from recorder import capture
from recorder.errors import RecordingError, ReplayError
from recorder.framework import FrameworkCallback, auto_modules, pdbg_program
from tests.cli import python
from tests.recorder.test_flight import payload_iterations

ROOT = Path(__file__).resolve().parents[2]


# -- helpers ----------------------------------------------------------------------------------------
def poison(module: nn.Module, when: Callable[[], bool]) -> None:
    """Make ``module`` produce NaN whenever ``when()`` holds. Done inside its call, not with a forward
    hook: torch runs global forward hooks (the recorder's) before a module's own, so a hook's change
    would happen after the recording saw the output."""
    forward = module.forward

    def poisoned(*args: Any, **kwargs: Any) -> Any:
        out = forward(*args, **kwargs)
        return out * float("nan") if when() else out

    module.forward = poisoned  # type: ignore[method-assign]


@contextmanager
def recorder_warnings() -> Iterator[list[str]]:
    """The RecorderWarning messages given inside the block (the frameworks' own warnings left out)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found: list[str] = []
        yield found
    found += [str(w.message) for w in caught if issubclass(w.category, recorder.RecorderWarning)]


def forwards(rec: replayer.Recording) -> list[replayer.Step]:
    return [s for s in rec.steps if s.phase == "forward"]


def by_iteration(rec: replayer.Recording) -> dict[int, list[tuple[str, int]]]:
    """iteration -> [(module path, call)] of its forward steps, in order."""
    out: dict[int, list[tuple[str, int]]] = {}
    for s in forwards(rec):
        out.setdefault(s.iteration, []).append((s.module_path, s.call))
    return out


@pytest.fixture
def signals_kept() -> Iterator[None]:
    """Lightning's teardown puts back the signal handlers it found (a recording's among them): leave
    the test process's as they were."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


# -- PyTorch Lightning ------------------------------------------------------------------------------
BATCH, WIDTH = 4, 8


def lightning_data(batches: int, seed: int = 0) -> Any:
    from torch.utils.data import DataLoader, TensorDataset

    gen = torch.Generator().manual_seed(seed)
    data = TensorDataset(torch.randn(batches * BATCH, WIDTH, generator=gen),
                         torch.randn(batches * BATCH, WIDTH, generator=gen))
    return DataLoader(data, batch_size=BATCH)


def lightning_net(pl: Any, *, nan_at: int | None = None, skip_nonfinite: bool = True) -> Any:
    """A LightningModule whose layers live in a child (``training_step`` calls ``self.net(x)``, so
    the outermost module called is not the LightningModule), NaN in ``net.layers.1`` at global step
    ``nan_at``; with ``skip_nonfinite`` a non-finite gradient skips the update (nothing after it is
    poisoned)."""

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return x

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Stack()
            self.validated = 0
            poison(self.net.layers[1], lambda: self.training and self.trainer.global_step == nan_at)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = F.mse_loss(self.net(x), y)
            self.log("train_loss", loss, on_step=False, on_epoch=True)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.validated += 1
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            if skip_nonfinite and any(p.grad is not None and not torch.isfinite(p.grad).all()
                                      for p in self.parameters()):
                optimizer.zero_grad(set_to_none=True)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Net()


@pytest.fixture(scope="module")
def pl() -> Any:
    return pytest.importorskip("lightning.pytorch")


def lightning_fit(pl: Any, callback: Any, model: Any, batches: int = 20, val: Any = None, **options: Any) -> Any:
    trainer = pl.Trainer(max_steps=options.pop("max_steps", 20), logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=callback if isinstance(callback, list) else [callback], **options)
    trainer.fit(model, lightning_data(batches), val)
    return trainer


@pytest.mark.usefixtures("signals_kept")
class TestLightning:
    def test_nan_at_step_12_is_named_kept_and_reported(self, pl: Any, tmp_path: Path) -> None:
        """20 steps, NaN in one layer at global step 12: the bisect names that layer's forward at
        iteration 12, iterations 0-19 each hold the three layers, payloads exist for 11-12 (the
        ring) and 18-19 (the end) only, bit for bit, and one warning gives the command to open it."""
        from recorder.lightning import PaperDebuggerCallback

        path = tmp_path / "run.zarr"
        with recorder_warnings() as said:
            lightning_fit(pl, PaperDebuggerCallback(path), lightning_net(pl, nan_at=12))
        rec = replayer.open(path)
        origin = replayer.first_nonfinite(rec).step
        assert rec.status == "complete"
        assert (origin.module_path, origin.phase, origin.iteration) == ("net.layers.1", "forward", 12)
        layers = [f"net.layers.{i}" for i in range(3)]
        assert {it: [p for p, _ in steps] for it, steps in by_iteration(rec).items()} == \
            {it: layers for it in range(20)}
        recorded, kept = payload_iterations(path)
        assert recorded == set(range(20)) and kept == {11, 12, 18, 19}
        x = lightning_data(20).dataset.tensors[0][12 * BATCH:13 * BATCH]
        first = next(s for s in forwards(rec) if s.iteration == 12 and s.module_path == "net.layers.0")
        assert torch.equal(first.tensor("args.0").view(torch.int32), x.view(torch.int32))
        assert len(said) == 1
        assert "Linear at net.layers.1 forward, iteration 12" in said[0] and "NaN" in said[0]
        assert said[0].endswith(f"open it there: {pdbg_program()} {path} --at {origin.index}")

    def test_detect_anomaly_crash_is_recorded(self, pl: Any, tmp_path: Path) -> None:
        """Trainer(detect_anomaly=True) makes backward raise at the NaN: on_exception closes the run
        crashed with that exception, the bisect still names the step, and the user is told."""
        from recorder.lightning import PaperDebuggerCallback

        path = tmp_path / "run.zarr"
        with recorder_warnings() as said, pytest.raises(RuntimeError, match="nan"):
            lightning_fit(pl, PaperDebuggerCallback(path), lightning_net(pl, nan_at=12, skip_nonfinite=False),
                          detect_anomaly=True)
        rec = replayer.open(path)
        origin = replayer.first_nonfinite(rec).step
        assert rec.status == "crashed"
        assert "RuntimeError" in rec.rank.final["exception"]["type"] and "nan" in rec.rank.final["exception"]["message"]
        assert (origin.module_path, origin.iteration) == ("net.layers.1", 12)
        assert max(s.iteration for s in rec.steps) == 12
        assert len(said) == 2 and "iteration 12" in said[0]
        assert "training stopped with RuntimeError" in said[1] and "(crashed)" in said[1]
        assert f"pdbg {path} --at {origin.index}" in said[1]
        assert capture.ACTIVE is None

    def test_gradient_accumulation_shares_iterations(self, pl: Any, tmp_path: Path) -> None:
        """accumulate_grad_batches=2: 20 batches, 10 optimizer steps, 10 iterations whose two
        micro-batches are calls #0 and #1; a list of globs replaces the automatic choice."""
        from recorder.lightning import PaperDebuggerCallback

        path = tmp_path / "run.zarr"
        with recorder_warnings() as said:
            trainer = lightning_fit(pl, PaperDebuggerCallback(path, modules=["net.layers.1"]), lightning_net(pl),
                                    max_steps=10, accumulate_grad_batches=2)
        assert trainer.global_step == 10 and not said
        rec = replayer.open(path)
        assert by_iteration(rec) == {it: [("net.layers.1", 0), ("net.layers.1", 1)] for it in range(10)}
        assert len([s for s in rec.steps if s.phase == "backward"]) == 20

    def test_manual_optimization_with_two_optimizers_keeps_the_last_batches(self, pl: Any, tmp_path: Path) -> None:
        """A GAN's training step steps two optimizers: the global step, and the iterations, go 0, 2, 4, 6;
        flight mode's keep=2 holds the tensors of the last two batches, not of one."""
        from recorder.lightning import PaperDebuggerCallback

        class Gan(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.automatic_optimization = False
                self.gen, self.disc = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 1)

            def training_step(self, batch: Any, batch_idx: int) -> None:
                opt_gen, opt_disc = self.optimizers()
                fake = self.gen(batch[1])
                opt_disc.zero_grad()
                self.manual_backward(self.disc(batch[0]).mean() - self.disc(fake.detach()).mean())
                opt_disc.step()
                opt_gen.zero_grad()
                self.manual_backward(self.disc(fake).mean())
                opt_gen.step()

            def configure_optimizers(self) -> Any:
                return [torch.optim.SGD(self.gen.parameters(), lr=0.01),
                        torch.optim.SGD(self.disc.parameters(), lr=0.01)]

        path = tmp_path / "run.zarr"
        trainer = lightning_fit(pl, PaperDebuggerCallback(path, keep=2), Gan(), batches=4, max_steps=8)
        assert trainer.global_step == 8
        assert payload_iterations(path) == ({0, 2, 4, 6}, {4, 6})

    def test_clean_fit_with_validation_records_training_only(self, pl: Any, tmp_path: Path) -> None:
        """No NaN: no warning, the run is complete; the sanity check and four validations ran their
        forwards, none of them recorded (every recorded forward has its backward)."""
        from recorder.lightning import PaperDebuggerCallback

        path = tmp_path / "run.zarr"
        net = lightning_net(pl)
        with recorder_warnings() as said:
            lightning_fit(pl, PaperDebuggerCallback(path), net, val=lightning_data(2, seed=1),
                          val_check_interval=5, num_sanity_val_steps=2)
        assert net.validated == 2 + 4 * 2 and not said
        rec = replayer.open(path)
        assert rec.status == "complete"
        assert len(forwards(rec)) == 20 * 3 and len(rec) == 2 * 20 * 3
        assert all(rec.step(s.index).status == "ok" for s in forwards(rec))

    def test_a_nan_check_raising_in_validation_is_said_to_be_unrecorded(self, pl: Any, tmp_path: Path) -> None:
        """validation_step's NaN check raising after five training steps: the run closes crashed marked
        raised during validation, the warning says the callback does not record it, and bisect says the
        NaN was made there, not between the recorded steps (no advice to record the loss as a step)."""
        from recorder.lightning import PaperDebuggerCallback

        class Checked(type(lightning_net(pl))):  # type: ignore[misc]
            def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
                loss = F.mse_loss(self.net(batch[0]), batch[1]) * float("nan")
                assert torch.isfinite(loss), "validation loss is nan"
                return loss

        path = tmp_path / "run.zarr"
        with recorder_warnings() as said, pytest.raises(AssertionError, match="validation loss is nan"):
            lightning_fit(pl, PaperDebuggerCallback(path), Checked(), val=lightning_data(2, seed=1),
                          val_check_interval=5, num_sanity_val_steps=0)
        assert len(said) == 1 and "raised during validation, which this callback does not record" in said[0]
        rec = replayer.open(path)
        assert rec.status == "crashed" and rec.rank.final["raised_during"] == "validation"
        assert rec.ended_by == "AssertionError: validation loss is nan, raised during validation"
        origin = replayer.first_nonfinite(rec)
        assert origin.step is None and origin.ended_by == rec.ended_by
        assert "records training steps only, not validation" in origin.cause
        assert "record the code between them" not in origin.cause

    @pytest.mark.parametrize("first", [True, False], ids=["user_callback_first", "pdbg_first"])
    def test_a_callback_that_runs_the_model_is_not_recorded_whatever_the_order(self, pl: Any, tmp_path: Path,
                                                                               first: bool) -> None:
        """A user's callback that runs the model in on_train_batch_start and on_train_batch_end (a
        sample between batches), before or after the recorder's in the list, and the module's own
        on_train_batch_end hook doing the same: none of their calls is recorded, only training's."""
        from recorder.lightning import PaperDebuggerCallback

        ran: list[str] = []

        def sample(module: Any, where: str) -> None:
            with torch.no_grad():
                module.net(torch.ones(1, WIDTH))
            ran.append(where)

        class Sampler(pl.Callback):
            def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
                sample(pl_module, "start")

            def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                                   batch_idx: int) -> None:
                sample(pl_module, "end")

        net = lightning_net(pl)
        net.on_train_batch_end = lambda outputs, batch, batch_idx: sample(net, "module")  # type: ignore[method-assign]
        path = tmp_path / "run.zarr"
        callbacks = [Sampler(), PaperDebuggerCallback(path)]
        lightning_fit(pl, callbacks if first else callbacks[::-1], net, batches=4, max_steps=4)
        assert sorted(ran) == sorted(["start", "end", "module"] * 4)
        rec = replayer.open(path)
        layers = [(f"net.layers.{i}", i) for i in range(3)]
        assert by_iteration(rec) == {it: layers for it in range(4)}
        assert len(rec) == 2 * 4 * 3

    def test_an_epoch_cut_short_by_its_batch_start_records_no_more_of_it(self, pl: Any, tmp_path: Path) -> None:
        """on_train_batch_start returning -1 skips the rest of the epoch, and that batch gets no batch
        end: what runs next (validation, a forward at the epoch's end, here on NaN input) is not
        recorded as a training step (it was, and its NaN was reported as the run's)."""
        from recorder.lightning import PaperDebuggerCallback

        net = lightning_net(pl)

        def start(batch: Any, batch_idx: int) -> int | None:
            return -1 if batch_idx == 3 else None

        def epoch_end() -> None:
            with torch.no_grad():
                net.net(torch.full((2, WIDTH), float("nan")))

        net.on_train_batch_start = start
        net.on_train_epoch_end = epoch_end
        path = tmp_path / "run.zarr"
        with recorder_warnings() as said:
            trainer = lightning_fit(pl, PaperDebuggerCallback(path), net, batches=8, max_steps=-1, max_epochs=2,
                                    val=lightning_data(2, seed=1), num_sanity_val_steps=0)
        assert trainer.global_step == 6 and not said, said
        rec = replayer.open(path)
        assert rec.status == "complete" and all(s.status == "ok" for s in rec.steps)
        assert by_iteration(rec) == {it: [("net.layers.0", 0), ("net.layers.1", 1), ("net.layers.2", 2)]
                                     for it in range(6)}

    def test_globs_that_match_nothing_are_said_after_the_first_step(self, pl: Any, tmp_path: Path) -> None:
        """modules= globs that select nothing are reported once, when the first training step ends
        (not when a long training that recorded nothing ends)."""
        from recorder.lightning import PaperDebuggerCallback

        net = lightning_net(pl)
        seen: list[int] = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")

            def ours() -> list[str]:
                return [str(w.message) for w in caught if issubclass(w.category, recorder.RecorderWarning)]

            net.on_train_batch_start = lambda *a: seen.append(len(ours()))  # said before each batch starts
            lightning_fit(pl, PaperDebuggerCallback(tmp_path / "run.zarr", modules=["layers.*"]), net, max_steps=3)
        said = ours()
        assert len(said) == 1 and "'layers.*' matched no module in the first training step" in said[0]
        assert "'net.layers.0'" in said[0] and seen == [0, 1, 1], seen

    def test_early_stopping_on_a_non_finite_loss_closes_complete(self, pl: Any, tmp_path: Path) -> None:
        """EarlyStopping(check_finite=True) ends the fit normally at the epoch whose loss is NaN: the
        run is complete, stops there, and names the step."""
        from lightning.pytorch.callbacks import EarlyStopping

        from recorder.lightning import PaperDebuggerCallback

        path = tmp_path / "run.zarr"
        stop = EarlyStopping(monitor="train_loss", check_finite=True, check_on_train_epoch_end=True, patience=100)
        trainer = pl.Trainer(max_steps=40, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=[PaperDebuggerCallback(path), stop])
        with recorder_warnings() as said:
            trainer.fit(lightning_net(pl, nan_at=12, skip_nonfinite=False), lightning_data(4))
        assert trainer.global_step == 16 and len(said) == 1
        rec = replayer.open(path)
        assert rec.status == "complete"
        assert sorted({s.iteration for s in rec.steps}) == list(range(16))
        origin = replayer.first_nonfinite(rec).step
        assert (origin.module_path, origin.iteration) == ("net.layers.1", 12)

    def test_an_existing_path_is_refused(self, pl: Any, tmp_path: Path) -> None:
        """A non-empty path is a one-line RecordingError naming it, before any step; a second fit with
        the same callback says how to go on, and does with a new path."""
        from recorder.lightning import PaperDebuggerCallback

        taken = tmp_path / "taken.zarr"
        taken.mkdir()
        (taken / "notes.txt").write_text("mine")
        with pytest.raises(RecordingError) as err:
            lightning_fit(pl, PaperDebuggerCallback(taken), lightning_net(pl))
        assert str(taken) in str(err.value) and "\n" not in str(err.value)
        assert capture.ACTIVE is None

        callback = PaperDebuggerCallback(tmp_path / "first.zarr")
        lightning_fit(pl, callback, lightning_net(pl), max_steps=2)
        with pytest.raises(RecordingError, match="callback.path") as err:
            lightning_fit(pl, callback, lightning_net(pl), max_steps=2)
        assert "first.zarr" in str(err.value) and "\n" not in str(err.value)
        callback.path = tmp_path / "second.zarr"
        lightning_fit(pl, callback, lightning_net(pl), max_steps=2)
        assert replayer.open(callback.path).status == "complete" and len(replayer.open(callback.path)) == 12

    @pytest.mark.slow
    def test_sigterm_after_a_crashed_fit_closes_the_next_recording(self, pl: Any, tmp_path: Path) -> None:
        """A fit that raised closes its recording, and Lightning's teardown then puts back the
        recording's SIGTERM handler it had saved. The next fit's recording must take the program's
        own handler, not the closed one's. SIGTERM in that fit writes the ring, and Lightning's own
        handler, which runs the recording's beside its own, ends the fit as it does without a
        recording: it finishes the batch and raises SIGTERMException into every callback's
        on_exception (an emergency checkpoint), which closes the recording crashed. The recording's
        handler, standing for none, ended the process there before, on_exception never called."""
        first, second = tmp_path / "a.zarr", tmp_path / "b.zarr"
        code = textwrap.dedent(f"""
            import os, signal, sys
            import lightning.pytorch as pl
            from recorder.lightning import PaperDebuggerCallback
            from tests.recorder import test_framework_callbacks as t
            net = t.lightning_net(pl)
            crash = net.training_step
            def broken(batch, batch_idx):
                if net.trainer.global_step == 2:
                    raise RuntimeError("boom")
                return crash(batch, batch_idx)
            net.training_step = broken
            try:
                t.lightning_fit(pl, PaperDebuggerCallback({str(first)!r}), net, max_steps=5)
            except RuntimeError:
                pass
            net = t.lightning_net(pl)
            step = net.training_step
            def killed(batch, batch_idx):
                if net.trainer.global_step == 3:
                    os.kill(os.getpid(), signal.SIGTERM)
                return step(batch, batch_idx)
            net.training_step = killed
            class Emergency(pl.Callback):
                def on_exception(self, trainer, module, exception):
                    print("on_exception:", type(exception).__name__)
            t.lightning_fit(pl, [Emergency(), PaperDebuggerCallback({str(second)!r})], net, max_steps=6)
        """)
        proc = python("-c", code, cwd=ROOT)
        assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
        assert "on_exception: SIGTERMException" in proc.stdout, proc.stdout  # (then Lightning exits, status 0)
        assert replayer.open(first).status == "crashed"
        rec = replayer.open(second)
        assert rec.status == "crashed" and rec.rank.final["flight"]["dumps"][0]["reason"] == "SIGTERM"
        assert rec.rank.final["exception"]["type"].endswith("SIGTERMException"), rec.rank.final["exception"]
        recorded, kept = payload_iterations(second)
        # the batch under way when it came is finished: the ring written at the signal (1, 2) and at the end (2, 3)
        assert max(recorded) == 3 and kept == {1, 2, 3}

    def test_ddp_ranks_record_into_one_path(self, pl: Any, tmp_path: Path) -> None:
        """Lightning DDP (two CPU processes, gloo): each rank records its own group into the same
        path, with module paths relative to the LightningModule, not to the DDP wrapper."""
        path = tmp_path / "run.zarr"
        proc = python(str(ROOT / "tests" / "scripts" / "lightning_ddp.py"), str(path), cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        rec = replayer.open(path)
        assert rec.ranks == [0, 1] and rec.status == "complete"
        for rank in (0, 1):
            mine = rec.of_rank(rank)
            assert mine.rank.dist == {"rank": rank, "world_size": 2, "backend": "gloo"}
            assert by_iteration(mine) == {it: [("layers.0", 0), ("layers.1", 1)] for it in range(3)}


# -- Hugging Face -----------------------------------------------------------------------------------
VOCAB, SEQ = 64, 16


class Squashed(nn.Module):
    """A layer keeping a lambda (not data) as an attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.squash = lambda t: torch.tanh(t) * 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.squash(self.lin(x))


@pytest.fixture
def hf(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    pytest.importorskip("accelerate")  # the Trainer needs it
    return pytest.importorskip("transformers")


class TokenData(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int = 0) -> None:
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def hf_trainer(hf: Any, tmp_path: Path, callback: Any, *, nan_at: int | None = None, raise_at: int | None = None,
               use_cache: bool = False, **args: Any) -> Any:
    """A two-block GPT-2 from a small config (no weights downloaded) in a Trainer; NaN out of block
    1 at global step ``nan_at``, an exception out of it at ``raise_at``. Without the cache, as the
    recorder advises (see test_the_cache_is_named_as_what_keeps_steps_from_replaying)."""
    torch.manual_seed(0)
    model = hf.GPT2LMHeadModel(hf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
                                             bos_token_id=0, eos_token_id=0, use_cache=use_cache))
    options = {"max_steps": 20, "per_device_train_batch_size": 2, "report_to": [], "save_strategy": "no",
               "use_cpu": True, "disable_tqdm": True, "logging_steps": 1, "learning_rate": 1e-3, **args}
    if "use_cache" in hf.TrainingArguments.__dataclass_fields__:  # transformers 5 sets config.use_cache from it
        options["use_cache"] = use_cache
    trainer = hf.Trainer(model=model, args=hf.TrainingArguments(output_dir=str(tmp_path / "out"), **options),
                         train_dataset=TokenData(80), eval_dataset=TokenData(4, seed=1), callbacks=[callback])
    block = model.transformer.h[1]
    poison(block, lambda: model.training and trainer.state.global_step == nan_at)
    forward = block.forward

    def fragile(*a: Any, **k: Any) -> Any:
        if model.training and trainer.state.global_step == raise_at:
            raise OverflowError("block 1 gave up")
        return forward(*a, **k)

    block.forward = fragile
    return trainer


class TestHuggingFace:
    def test_nan_at_step_12_is_named_though_the_trainer_hides_it(self, hf: Any, tmp_path: Path) -> None:
        """NaN out of block 1 at step 12: the Trainer's logs show no NaN loss (logging_nan_inf_filter)
        and training goes on, but the bisect names that block at iteration 12 and the warning gives
        `pdbg PATH --at N` with N that step's index; evaluation forwards are not recorded."""
        from recorder.huggingface import PaperDebuggerCallback

        path = tmp_path / "run.zarr"
        trainer = hf_trainer(hf, tmp_path, PaperDebuggerCallback(path), nan_at=12, eval_strategy="steps",
                             eval_steps=10)
        with recorder_warnings() as said:
            trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        assert len(losses) == 20 and all(torch.isfinite(torch.tensor(losses)))
        assert sum("eval_loss" in h for h in trainer.state.log_history) == 2
        rec = replayer.open(path)
        origin = replayer.first_nonfinite(rec).step
        assert rec.status == "complete"
        assert (origin.module_path, origin.phase, origin.iteration) == ("transformer.h.1", "forward", 12)
        blocks = [("transformer.h.0", 0), ("transformer.h.1", 1)]
        assert by_iteration(rec) == {it: blocks for it in range(20)}
        assert len(said) == 1 and "GPT2Block at transformer.h.1 forward, iteration 12, call 1" in said[0]
        assert said[0].endswith(f"open it there: {pdbg_program()} {path} --at {origin.index}")
        # The recorded steps replay bit for bit (the model's config, a dataclass, with the attention
        # implementation set after it was made): block 0 of the anomaly's iteration and the last one's.
        kept = [s for s in rec.steps.filter(iteration=12) if s.module_path == "transformer.h.0"]
        kept += [s for s in rec.steps.filter(iteration=19)]
        assert len(kept) == 2 + 4
        for step in kept:
            result = replayer.replay(rec, step.index)
            assert result.match and result.outputs, (step.selector, [d.summary() for d in result.outputs])

    def test_the_cache_is_named_as_what_keeps_steps_from_replaying(self, hf: Any, tmp_path: Path) -> None:
        """With config.use_cache the model hands each block its cache object, which is not data: the
        first step given it says so once, naming the argument and the fix, at the user's line (not
        the Trainer's), and a replay of a block's step is refused in one line naming the cache."""
        from recorder.huggingface import PaperDebuggerCallback

        path = tmp_path / "run.zarr"
        trainer = hf_trainer(hf, tmp_path, PaperDebuggerCallback(path), max_steps=2, use_cache=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train()
        said = [w for w in caught if issubclass(w.category, recorder.RecorderWarning)]
        assert len(said) == 1, [str(w.message) for w in said]
        message = str(said[0].message)
        assert "GPT2Block at transformer.h.0 was given cache, a DynamicCache that is not recorded" in message
        assert "cannot be replayed" in message and "use_cache=False" in message
        assert said[0].filename == __file__
        rec = replayer.open(path)
        step = rec.steps.filter(iteration=1)[0]
        with pytest.raises(ReplayError, match=r"was called with a transformers DynamicCache as cache \(its layers: "
                                              r"\w+ objects\), which could not be recorded as data") as info:
            replayer.replay(rec, step.index)
        assert "\n" not in str(info.value)

    def test_generate_inside_a_recording_is_said_not_to_replay(self, hf: Any, tmp_path: Path) -> None:
        """generate() passes its cache whatever config.use_cache says (it reads generation_config, made
        with the model): recording its layers warns once, naming the cache argument, at the line that
        called generate(); the forward called without a cache replays bit for bit."""
        torch.manual_seed(0)
        model = hf.GPT2LMHeadModel(hf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
                                                 bos_token_id=0, eos_token_id=0, pad_token_id=0))
        model.config.use_cache = False  # (what the warning used to advise: generate() still passes a cache)
        model.eval()
        prompt = torch.tensor([[1, 2, 3]])
        path = tmp_path / "run.zarr"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with recorder.record(path, model=model, modules="transformer.h.*", mode="full") as run:
                with torch.no_grad():
                    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3,
                                         do_sample=False, pad_token_id=0)
                run.next_iteration()
                model(out, use_cache=False).logits.sum().backward()
        said = [w for w in caught if issubclass(w.category, recorder.RecorderWarning)]
        assert len(said) == 1, [str(w.message) for w in said]
        assert "GPT2Block at transformer.h.0 was given " in str(said[0].message)
        assert "a DynamicCache that is not recorded as data" in str(said[0].message)
        assert said[0].filename == __file__
        rec = replayer.open(path)
        for step in rec.steps.filter(iteration=1):
            result = replayer.replay(rec, step.index)
            assert result.match and result.outputs, (step.selector, [d.summary() for d in result.outputs])

    def test_llama_layers_trained_by_the_trainer_replay(self, hf: Any, tmp_path: Path) -> None:
        """Llama's attention (transformers' @use_kernelized_func) holds _kernel_funcs: modules wrapping its
        rotary function, of a class made inside a function. The callback's default choice, the decoder
        layers, records without a warning, and their forward and backward steps replay bit for bit, the
        attention rebuilt from its skeleton with those modules made again (before, every layer's replay was
        refused)."""
        from recorder.huggingface import PaperDebuggerCallback

        torch.manual_seed(0)
        model = hf.LlamaForCausalLM(hf.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                                   num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB,
                                                   max_position_embeddings=32, use_cache=False))
        path = tmp_path / "run.zarr"
        options = {"max_steps": 2, "per_device_train_batch_size": 2, "report_to": [], "save_strategy": "no",
                   "use_cpu": True, "disable_tqdm": True, "learning_rate": 1e-3}
        trainer = hf.Trainer(model=model, args=hf.TrainingArguments(output_dir=str(tmp_path / "out"), **options),
                             train_dataset=TokenData(8), callbacks=[PaperDebuggerCallback(path, mode="full")])
        with recorder_warnings() as said:
            trainer.train()
        assert not said
        rec = replayer.open(path)
        steps = rec.steps.filter(iteration=1)
        assert sorted((s.module_path, s.phase) for s in steps) == [
            (f"model.layers.{i}", phase) for i in range(2) for phase in ("backward", "forward")]
        for step in steps:
            result = replayer.replay(rec, step.index)
            assert result.match and result.outputs, (step.selector, [d.summary() for d in result.outputs])
            assert result.rebuilt[f"{step.module_path}.self_attn"] == "skeleton"
            assert not result.warnings, result.warnings

    def test_a_layer_a_replay_cannot_rebuild_is_said_when_recording(self, tmp_path: Path) -> None:
        """A module holding an attribute that is not data (a lambda), whose constructor arguments are not
        known: recording it says so once, at the user's line, naming it, and a replay of it says the same;
        its part that holds none is recorded without a word and replays."""
        torch.manual_seed(0)
        model = nn.Sequential(Squashed(), nn.Linear(4, 2))
        x = torch.randn(3, 4)
        for modules, path in (["0"], tmp_path / "layer.zarr"), (["0.lin"], tmp_path / "part.zarr"):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with recorder.record(path, model=model, modules=modules, mode="full"):
                    model(x).sum().backward()
                    model(x).sum().backward()
            said = [w for w in caught if issubclass(w.category, recorder.RecorderWarning)]
            if modules == ["0.lin"]:
                assert not said, [str(w.message) for w in said]
                rec = replayer.open(path)
                assert all(replayer.replay(rec, step.index).match for step in rec.steps)
                continue
            assert len(said) == 1, [str(w.message) for w in said]
            assert str(said[0].message).startswith(  # (a function by its qualified name, not as builtins:function)
                f"PaperDebugger: Squashed at 0 holds squash, the lambda {__name__}:Squashed.__init__.<locals>.<lambda> "
                "that is not recorded as data"), said[0].message
            assert "fail to replay where their code uses it" in str(said[0].message)
            assert said[0].filename == __file__
            rec = replayer.open(path)
            with pytest.raises(ReplayError, match="squash"):
                replayer.replay(rec, rec.steps[0].index)

    @pytest.mark.parametrize("kwargs", [None, {"use_reentrant": True}], ids=["default", "reentrant"])
    def test_layers_under_gradient_checkpointing_replay(self, hf: Any, tmp_path: Path,
                                                        kwargs: dict[str, Any] | None) -> None:
        """With gradient checkpointing each layer holds torch's checkpoint function with its options
        (a functools.partial): it is recorded, and the layers' forward and backward steps replay bit
        for bit, through the checkpoint as in training (the reentrant variant too), without a warning."""
        from recorder.huggingface import PaperDebuggerCallback

        path = tmp_path / "run.zarr"
        trainer = hf_trainer(hf, tmp_path, PaperDebuggerCallback(path, mode="full"), max_steps=2,
                             gradient_checkpointing=True, gradient_checkpointing_kwargs=kwargs)
        with recorder_warnings() as said:
            trainer.train()
        assert not said
        rec = replayer.open(path)
        steps = rec.steps.filter(iteration=1)
        assert [s.phase for s in steps] == ["forward", "forward", "backward", "backward"]
        for step in steps:
            result = replayer.replay(rec, step.index)
            assert result.match and result.rebuilt[step.module_path] == "skeleton", result
        layer = trainer.model.transformer.h[0]
        assert layer._gradient_checkpointing_func.keywords == (kwargs or {"use_reentrant": False})

    def test_a_checkpoint_function_not_recorded_is_named(self, hf: Any, tmp_path: Path) -> None:
        """A checkpoint function that is not data (transformers' offload=True makes one of its own):
        the callback says so when training starts, naming it (the replays failed without a word of why)."""
        from recorder.huggingface import PaperDebuggerCallback

        path = tmp_path / "run.zarr"
        trainer = hf_trainer(hf, tmp_path, PaperDebuggerCallback(path), max_steps=2)
        trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        checkpoint = trainer.model.transformer.h[0]._gradient_checkpointing_func

        def offloading(function: Any, *args: Any, **kwargs: Any) -> Any:
            return checkpoint(function, *args, **kwargs)

        for layer in trainer.model.transformer.h:
            layer._gradient_checkpointing_func = offloading
        with recorder_warnings() as said:
            trainer.train()
        # (and, from the recording of the first layer, the attribute no replay can make again)
        assert said[1:] and all("holds _gradient_checkpointing_func" in s for s in said[1:]), said
        said = said[:1]
        assert len(said) == 1 and "gradient checkpointing is on (transformer.h.0) with a checkpoint function " \
            "(TestHuggingFace.test_a_checkpoint_function_not_recorded_is_named.<locals>.offloading) that is not " \
            "recorded as data" in said[0], said
        assert said[0].endswith("(gradient_checkpointing_kwargs of plain values, no offload) or without "
                                "gradient_checkpointing")
        assert replayer.open(path).status == "complete"

    @pytest.mark.parametrize("first", [True, False], ids=["user_callback_first", "pdbg_first"])
    def test_a_callback_that_generates_is_not_recorded_whatever_the_order(self, hf: Any, tmp_path: Path,
                                                                          first: bool) -> None:
        """A user's TrainerCallback that generates in on_step_begin and on_step_end, before or after
        the recorder's in the list: none of its calls is recorded, only the training steps' (which
        replay), and no cache warning is given."""
        from recorder.huggingface import PaperDebuggerCallback

        samples: list[Any] = []

        class Sampler(hf.TrainerCallback):
            def _generate(self, model: Any) -> None:
                model.eval()
                with torch.no_grad():
                    prompt = torch.tensor([[1, 2, 3]])
                    samples.append(model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=2,
                                                  do_sample=False, pad_token_id=0, use_cache=True))
                model.train()

            def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
                self._generate(model)

            def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
                self._generate(model)

        path = tmp_path / "run.zarr"
        trainer = hf_trainer(hf, tmp_path, PaperDebuggerCallback(path), max_steps=3)
        if first:
            trainer.callback_handler.callbacks.insert(0, Sampler())
        else:
            trainer.add_callback(Sampler())
        with recorder_warnings() as said:
            trainer.train()
        assert len(samples) == 2 * 3 and not said
        rec = replayer.open(path)
        blocks = [("transformer.h.0", 0), ("transformer.h.1", 1)]
        assert by_iteration(rec) == {it: blocks for it in range(3)}
        assert len(rec) == 2 * 3 * 2

    def test_gradient_accumulation_shares_iterations(self, hf: Any, tmp_path: Path) -> None:
        """gradient_accumulation_steps=2: 5 optimizer steps, 5 iterations, each with both blocks of
        both micro-batches (GPT2Block calls #0-#3)."""
        from recorder.huggingface import PaperDebuggerCallback

        path = tmp_path / "run.zarr"
        trainer = hf_trainer(hf, tmp_path, PaperDebuggerCallback(path), max_steps=5, gradient_accumulation_steps=2)
        with recorder_warnings() as said:
            trainer.train()
        assert trainer.state.global_step == 5 and not said
        blocks = [("transformer.h.0", 0), ("transformer.h.1", 1), ("transformer.h.0", 2), ("transformer.h.1", 3)]
        assert by_iteration(replayer.open(path)) == {it: blocks for it in range(5)}

    def test_an_exception_out_of_train_leaves_no_open_run(self, hf: Any, tmp_path: Path) -> None:
        """train() raising leaves the recording open (the Trainer has no exception event); the next
        train() with the callback closes it crashed before refusing the path it holds, and close()
        says crashed; the step the exception left is recorded."""
        from recorder.huggingface import PaperDebuggerCallback

        path = tmp_path / "run.zarr"
        callback = PaperDebuggerCallback(path)
        trainer = hf_trainer(hf, tmp_path, callback, raise_at=5)
        with pytest.raises(OverflowError):
            trainer.train()
        assert capture.ACTIVE is not None and not callback.run.closed
        with recorder_warnings() as said, pytest.raises(RecordingError, match="callback.path"):
            trainer.train()
        assert len(said) == 1 and "(crashed)" in said[0]
        assert callback.close() == "crashed" and capture.ACTIVE is None
        rec = replayer.open(path)
        assert rec.status == "crashed"
        failed = [s for s in rec.steps if s.status == "exception"]
        assert [(s.module_path, s.iteration) for s in failed] == [("transformer.h.1", 5)]


    def test_an_exception_in_evaluation_is_said_to_be_unrecorded(self, hf: Any, tmp_path: Path) -> None:
        """An evaluation that train() runs between steps raising: the run, closed with that exception, is
        marked raised during evaluation, and bisect says the NaN was made there, not between the
        recorded steps."""
        from recorder.huggingface import PaperDebuggerCallback

        path = tmp_path / "run.zarr"
        callback = PaperDebuggerCallback(path)
        trainer = hf_trainer(hf, tmp_path, callback, eval_strategy="steps", eval_steps=3)
        block = trainer.model.transformer.h[1]
        forward = block.forward

        def checked(*a: Any, **k: Any) -> Any:
            if not trainer.model.training:
                raise FloatingPointError("eval loss is nan")
            return forward(*a, **k)

        block.forward = checked
        with pytest.raises(FloatingPointError) as raised:
            trainer.train()
        with recorder_warnings() as said:
            assert callback.close(raised.value) == "crashed"
        assert len(said) == 1 and "raised during evaluation (Trainer.evaluate)" in said[0]
        rec = replayer.open(path)
        assert rec.rank.final["raised_during"] == "evaluation (Trainer.evaluate)"
        origin = replayer.first_nonfinite(rec)
        assert origin.step is None and "records training steps only, not evaluation" in origin.cause
        assert "record the code between them" not in origin.cause

    def test_after_train_raised_nothing_else_is_recorded(self, hf: Any, tmp_path: Path) -> None:
        """The Trainer reports no exception: after train() raised in step 5, trainer.evaluate() and
        the user's own calls of the model are not recorded as that step's (the recording stays open,
        paused). Closed crashed by the next train() after callback.path was set to a new path, it is
        named by its own path, not the new one."""
        from recorder.huggingface import PaperDebuggerCallback

        first, second = tmp_path / "a.zarr", tmp_path / "b.zarr"
        callback = PaperDebuggerCallback(first)
        trainer = hf_trainer(hf, tmp_path, callback, raise_at=5)
        with pytest.raises(OverflowError):
            trainer.train()
        trainer.evaluate()
        trainer.model.train()
        trainer.model.transformer.h[0](torch.zeros(1, SEQ, 32))  # a recorded module, called by hand
        assert not callback.run.closed and callback.run.is_paused
        callback.path = second
        with recorder_warnings() as said, pytest.raises(OverflowError):
            trainer.train()
        assert callback.close() == "crashed"
        assert len(said) == 1 and f"the recording (crashed) is in {first}; open it there: {pdbg_program()} {first}" \
            in said[0]
        blocks = [("transformer.h.0", 0), ("transformer.h.1", 1)]
        assert by_iteration(replayer.open(first)) == {it: blocks for it in range(6)}
        assert by_iteration(replayer.open(second)) == {it: blocks for it in range(6)}

    def test_a_new_callback_after_train_raised_records(self, hf: Any, tmp_path: Path) -> None:
        """A notebook cell run again after train() raised: a new Trainer and a new callback. The
        first callback's recording (left open: the Trainer reports no exception) is closed crashed,
        and the new training records (it was refused: "a recording is already active")."""
        from recorder.huggingface import PaperDebuggerCallback

        first, second = tmp_path / "a.zarr", tmp_path / "b.zarr"
        old = PaperDebuggerCallback(first)
        with pytest.raises(OverflowError):
            hf_trainer(hf, tmp_path, old, raise_at=2).train()
        new = PaperDebuggerCallback(second)
        with recorder_warnings() as said:
            hf_trainer(hf, tmp_path, new).train()
        assert len(said) == 1 and f"the recording (crashed) is in {first}" in said[0]
        assert old.run.status == "crashed" and replayer.open(first).status == "crashed"
        assert new.run.status == "complete" and replayer.open(second).status == "complete"


# -- what the callbacks share ------------------------------------------------------------------------
class TestShared:
    def test_auto_modules(self) -> None:
        """Paper steps when there are any; else the outermost lists' elements; else the children."""
        class Block(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.mlp = nn.Sequential(nn.Linear(2, 2), nn.ReLU())

        class GPT(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.transformer = nn.Module()
                self.transformer.h = nn.ModuleList(Block() for _ in range(3))
                self.transformer.ln = nn.LayerNorm(2)
                self.heads = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
                self.single = nn.ModuleList([nn.Linear(2, 2)])

        assert auto_modules(GPT()) == ["transformer.h.*", "heads.*"]
        assert auto_modules(nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU(), nn.ReLU()))) == ["*"]
        assert auto_modules(Block()) == ["mlp.*"]
        assert auto_modules(nn.TransformerEncoderLayer(4, 2)) == ["*"]
        assert auto_modules(nn.Linear(2, 2)) == ["**"]
        compiled = nn.Module()  # a compiled child: paths as the recorder names them, without _orig_mod
        compiled.net = torch.compile(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
        assert auto_modules(compiled) == ["net.*"]
        marked = GPT()
        recorder.annotate(marked.transformer.ln, "Eq. 3")
        assert auto_modules(marked) is None

    def test_pause_restores_state_exactly(self, run_path: Path) -> None:
        """Nothing inside paused() is recorded; pauses nest, and paused() leaves the count as it was
        however its block ends; resume() without a pause is an error."""
        model = nn.Linear(3, 3)
        with recorder.record(run_path, modules="**") as run:
            model(torch.ones(1, 3))
            run.pause()
            with pytest.raises(ValueError), run.paused():
                model(torch.ones(1, 3))
                run.resume()  # unbalanced inside the block: paused() still puts the count back
                raise ValueError
            assert run.is_paused
            model(torch.ones(1, 3))
            run.resume()
            assert not run.is_paused
            with pytest.raises(RecordingError, match="not paused"):
                run.resume()
            model(torch.full((1, 3), 2.0))
        rec = replayer.open(run_path)
        assert [s.tensor("args.0").tolist() for s in rec.steps] == [[[1.0] * 3], [[2.0] * 3]]

    def test_bad_options_are_refused_at_once(self) -> None:
        """A bad mode, glob or anomaly action, or a model/optimizer the callback supplies itself."""
        for bad in ({"mode": "fast"}, {"modules": ["a..b"]}, {"on_anomaly": "panic"}, {"optimizer": "auto"}):
            with pytest.raises(RecordingError):
                FrameworkCallback("run.zarr", **bad)

    def test_start_iteration_is_refused_the_global_step_numbers_the_iterations(self, tmp_path: Path) -> None:
        """A resumed training's iterations follow the framework's global step (its first training step is
        numbered by it): a start_iteration given to the callback is refused, as model and optimizer are."""
        with pytest.raises(RecordingError) as err:
            FrameworkCallback(tmp_path / "run.zarr", start_iteration=15)
        assert str(err.value) == ("the callback records the model the framework trains and numbers the iterations "
                                  "by its global step itself (a resumed training's too): leave out start_iteration")
        model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        callback = FrameworkCallback(tmp_path / "resumed.zarr")
        callback._begin(model)
        for global_step in (15, 16):  # resumed from the checkpoint of step 15
            callback._step_start(global_step)
            model(torch.ones(1, 2))
            callback._step_end()
        callback._end()
        assert [s.iteration for s in replayer.open(tmp_path / "resumed.zarr").steps] == [15, 15, 16, 16]

    def test_the_warnings_point_at_the_training_code(self, tmp_path: Path) -> None:
        """The NaN's warning and the crash's name the line of the training code that ran into them, not
        the recorder's own (where a warning's source line says nothing to the user)."""
        model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        callback = FrameworkCallback(tmp_path / "run.zarr")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            callback._begin(model)
            callback._step_start(0)
            model(torch.tensor([[float("nan"), 1.0]])).sum().backward()
            callback._step_end()
            callback._crash(ValueError("the loss is NaN"))
        said = [w for w in caught if issubclass(w.category, recorder.RecorderWarning)]
        assert [str(w.message).split(";")[0] for w in said] == [
            "PaperDebugger: Linear at 0 forward, iteration 0, call 0: output has 2 NaN",
            "PaperDebugger: training stopped with ValueError: the loss is NaN"]
        assert {w.filename for w in said} == {__file__}

    def test_a_run_left_open_closes_crashed_at_exit(self, tmp_path: Path) -> None:
        """A training that raises out of the process with its recording open: closed crashed at exit,
        with the exception that ended the process, and the user is told."""
        path = tmp_path / "run.zarr"
        code = textwrap.dedent(f"""
            import torch
            from recorder.framework import FrameworkCallback
            model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
            callback = FrameworkCallback({str(path)!r})
            callback._begin(model)
            callback._step_start(0)
            model(torch.ones(1, 2)).sum().backward()
            raise ValueError("the data loader broke")
        """)
        proc = python("-c", code, cwd=ROOT)
        assert proc.returncode == 1 and "ValueError: the data loader broke" in proc.stderr
        assert f"the recording (crashed) is in {path}" in proc.stderr
        rec = replayer.open(path)
        assert rec.status == "crashed" and rec.rank.final["exception"]["message"] == "the data loader broke"
        assert len(rec) == 4

    def test_missing_frameworks_name_the_extra(self) -> None:
        """Without the framework, importing its callback is a one-line ImportError naming the extra;
        `import recorder` imports neither; with only pytorch_lightning, its Callback is the base."""
        pytest.importorskip("pytorch_lightning")
        code = textwrap.dedent("""
            import sys
            import recorder
            assert "lightning" not in sys.modules and "transformers" not in sys.modules
            for name in ("lightning", "lightning.pytorch", "pytorch_lightning", "transformers"):
                sys.modules[name] = None
            for module in ("recorder.lightning", "recorder.huggingface"):
                try:
                    __import__(module)
                except ImportError as exc:
                    print(exc)
            del sys.modules["pytorch_lightning"], sys.modules["transformers"]  # (torchmetrics imports it)
            from recorder.lightning import PaperDebuggerCallback
            import pytorch_lightning
            print(issubclass(PaperDebuggerCallback, pytorch_lightning.Callback))
        """)
        proc = python("-c", code, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.splitlines() == [
            "recorder.lightning needs PyTorch Lightning: pip install paperdebugger[lightning]",
            "recorder.huggingface needs Hugging Face transformers: pip install paperdebugger[huggingface]",
            "True"]
