"""Child process of test_ring_cut: flight mode (the ring in this process, as ``recorder.record`` keeps it), a NaN
at iteration 5 writes the ring out, and the process is SIGKILLed in the middle of that write-out, after a commit
that holds part of it, as a periodic commit followed by the OOM killer would leave it.

    python ring_cut_child.py STORE
"""

from __future__ import annotations

import os
import signal
import sys

import torch

import recorder
from recorder.store import writer
from tests.recorder.crash_child import train_with_a_nan

KILL_AT = 3  # the payload attached to its record (a ``late/`` row) after which the process dies
_late = writer.StoreWriter.late
_attached = [0]


def late(self: writer.StoreWriter, tensor_row: int, payload: int) -> None:
    _late(self, tensor_row, payload)
    _attached[0] += 1
    if _attached[0] == KILL_AT:
        self.flush()  # a periodic commit lands in the middle of the write-out
        os.kill(os.getpid(), signal.SIGKILL)


@recorder.paper_step("Eq. 2", description="tanh")
def smooth(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * 2


def main(out: str) -> None:
    writer.StoreWriter.late = late  # type: ignore[method-assign]
    train_with_a_nan(smooth, out, 8, 5, mode="flight", keep=2, modules="**")

if __name__ == "__main__":
    main(sys.argv[1])
