"""PyTorch Lightning: ``Trainer(callbacks=[PaperDebuggerCallback("run.zarr")])`` records the fit.

A thin adapter over ``recorder.framework.FrameworkCallback`` (what is recorded, and when, is
described there and in the README, "Lightning and Hugging Face"). Lightning's events:

- ``on_fit_start``: the recording opens (paused), of the LightningModule; module paths are
  relative to it, whatever ``training_step`` calls (``self(x)``, ``self.net(x)``, a DDP wrapper).
- ``on_train_batch_start`` .. ``on_train_batch_end``: steps are recorded; the iteration is
  ``trainer.global_step``, so with ``accumulate_grad_batches`` the micro-batches of one optimizer
  step share an iteration. Sanity checks and validation run between batches: not recorded. Nor is
  what any callback's event or the LightningModule's own ``on_*`` hooks run (a callback that
  generates in ``on_train_batch_end``, before or after this one in the list).
- ``on_exception``: the recording closes ``crashed`` with the exception (``detect_anomaly=True``
  raising in backward, a KeyboardInterrupt, an error in ``training_step``); one raised in validation
  is marked so (``final.raised_during``): ``pdbg`` does not look for it between the training steps.
- ``on_fit_end``: it closes ``complete`` (also when EarlyStopping stopped the fit). Not at
  ``on_train_end``: Lightning's teardown, between the two, puts back the signal handlers it found,
  the recording's among them; closing after it lets the recording restore the ones before it.

Under DDP every rank records its own group into the same path.
"""

from __future__ import annotations

from typing import Any

from .framework import FrameworkCallback

try:
    from lightning.pytorch import Callback
    from lightning.pytorch.trainer import call as _call
except ImportError as exc:
    if exc.name not in ("lightning", "lightning.pytorch"):
        raise  # Lightning is there but broken: its own error says why
    try:
        from pytorch_lightning import Callback  # type: ignore[no-redef]
        from pytorch_lightning.trainer import call as _call  # type: ignore[no-redef]
    except ImportError as old:
        if old.name != "pytorch_lightning":
            raise
        raise ImportError("recorder.lightning needs PyTorch Lightning: pip install paperdebugger[lightning]") from None

__all__ = ["PaperDebuggerCallback"]


class PaperDebuggerCallback(FrameworkCallback, Callback):  # type: ignore[misc]
    """A Lightning callback that records the fit: ``Trainer(callbacks=[PaperDebuggerCallback("run.zarr")])``.

    Args:
        path: a new directory for the recording (a second fit needs a new one: set ``callback.path``).
        mode: "flight" (default), "stats" or "full", as for ``recorder.record``.
        keep: flight mode: iterations whose tensors are held in memory (default 2).
        modules: module-path globs relative to the LightningModule; None: the paper steps, else
            its layers (``recorder.framework.auto_modules``).
        on_anomaly: "record" (default), "stop" or "pdb".
        record_options: other options of ``recorder.record``.
    """

    # Every callback's event, and the LightningModule's own ``on_*`` hooks (not ``optimizer_step``
    # or ``backward``, through the same function, inside which the training step runs).
    _events = frozenset((_call._call_callback_hooks.__code__, _call._call_lightning_module_hook.__code__))

    def _is_event(self, frame: Any) -> bool:
        if frame.f_code is not _call._call_lightning_module_hook.__code__:
            return True
        return str(frame.f_locals.get("hook_name", "")).startswith("on_")

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._begin(pl_module)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._step_start(trainer.global_step)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._step_end()

    # A batch whose on_train_batch_start returned -1 (the rest of the epoch skipped) has no batch end:
    # its window closes before validation or the epoch's end, whose calls are not training steps.
    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._step_end()

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._step_end()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._crash(exception, _unrecorded_stage(trainer))

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._end()


def _unrecorded_stage(trainer: Any) -> str | None:
    """The stage of the fit, not recorded, that was running when it raised: validation (the sanity
    check's too); None for training."""
    if getattr(trainer, "sanity_checking", False):
        return "validation (Lightning's sanity check, before the first training step)"
    if getattr(trainer, "validating", False):
        return "validation"
    return None
