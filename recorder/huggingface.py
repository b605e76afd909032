"""Hugging Face: ``Trainer(..., callbacks=[PaperDebuggerCallback("run.zarr")])`` records ``train()``.

A thin adapter over ``recorder.framework.FrameworkCallback`` (what is recorded, and when, is
described there and in the README, "Lightning and Hugging Face"). The Trainer's events:

- ``on_train_begin``: the recording opens (paused), of the model passed to the Trainer; module
  paths are relative to it.
- ``on_step_begin`` .. ``on_step_end``: steps are recorded; the iteration is ``state.global_step``.
  With ``gradient_accumulation_steps`` the Trainer calls ``on_step_begin`` once per optimizer step,
  before its first micro-batch, so the micro-batches share an iteration. Evaluation, logging and
  saving run after ``on_step_end``: not recorded. Nor is what any callback's event runs (a
  ``TrainerCallback`` that generates in ``on_step_end`` or ``on_step_begin``, before or after this
  one in the list): steps called from inside the Trainer's ``CallbackHandler.call_event`` are not.
- ``on_train_end``: the recording closes ``complete``.

The Trainer has no exception event: when ``train()`` raises, the recording stays open until this
callback's ``close()``, its next ``on_train_begin`` (a notebook cell run again) or the end of the
process, each of which closes it ``crashed``. Meanwhile it records nothing: a step starts only while
the Trainer's frame that began the training step is on the stack (``Run.only_while``), so
``trainer.evaluate()`` after the exception is not recorded as the failed step's. A NaN loss,
which the Trainer leaves out of its logs (``logging_nan_inf_filter=True``) and trains on, is still
recorded, and the first step that produced it is reported. An exception that came out of the
Trainer's evaluation is marked so when the recording closes with it (``final.raised_during``):
``pdbg`` does not look for it between the training steps. Under DDP every rank records its own
group into the same path.
"""

from __future__ import annotations

import sys
from typing import Any

from .framework import FrameworkCallback

try:
    from transformers import Trainer, TrainerCallback
    from transformers.trainer_callback import CallbackHandler
except ImportError as exc:
    if exc.name != "transformers":
        raise  # transformers is there but broken: its own error says why
    raise ImportError("recorder.huggingface needs Hugging Face transformers: "
                      "pip install paperdebugger[huggingface]") from None

__all__ = ["PaperDebuggerCallback"]


class PaperDebuggerCallback(FrameworkCallback, TrainerCallback):  # type: ignore[misc]
    """A transformers ``TrainerCallback`` that records ``trainer.train()``:
    ``Trainer(model, args, train_dataset=..., callbacks=[PaperDebuggerCallback("run.zarr")])``.

    Args:
        path: a new directory for the recording (a second ``train()`` needs a new one: set
            ``callback.path``).
        mode: "flight" (default), "stats" or "full", as for ``recorder.record``.
        keep: flight mode: iterations whose tensors are held in memory (default 2).
        modules: module-path globs relative to the model; None: the paper steps, else its layers
            (``transformer.h.*``; ``recorder.framework.auto_modules``).
        on_anomaly: "record" (default), "stop" or "pdb".
        record_options: other options of ``recorder.record``.
    """

    _events = frozenset((CallbackHandler.call_event.__code__,))  # every event of every callback

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self._begin(model)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._step_start(state.global_step, _training_loop())

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._step_end()

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._step_end()  # (a step whose end never came: what follows is not training)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._end()

    def _raised_during(self, exception: BaseException) -> str | None:
        """Evaluation (``Trainer.evaluate``, which ``train()`` runs between steps), where the exception's
        traceback went through it."""
        tb = exception.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code in _EVALUATION:
                return "evaluation (Trainer.evaluate)"
            tb = tb.tb_next
        return None


# The Trainer's evaluation, which train() runs between training steps (eval_strategy): not recorded.
_EVALUATION = frozenset(getattr(Trainer, name).__code__ for name in ("evaluate", "evaluation_loop")
                        if hasattr(Trainer, name))


def _training_loop() -> Any:
    """The Trainer's frame that called the callback handler (its training loop), from an event
    method of the callback."""
    frame: Any = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("transformers.trainer_callback"):
        frame = frame.f_back
    return frame
