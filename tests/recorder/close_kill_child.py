"""Child process of test_torn_tail: records a NaN training to its end, and dies by SIGKILL as it closes, after its
final manifest was committed and before the final metadata was written.

    python -m tests.recorder.close_kill_child STORE [--no-kill]

``--no-kill``: the same recording, closed as usual (what the killed one's reader is compared with).
"""

from __future__ import annotations

import os
import signal
import sys

import torch

import recorder
from recorder.store import writer
from tests.recorder.crash_child import train_with_a_nan


@recorder.paper_step("Eq. 2", description="softplus")
def smooth(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.softplus(x)


def main(out: str, kill: bool) -> None:
    if kill:
        writer.StoreWriter._publish_final = lambda self: os.kill(os.getpid(), signal.SIGKILL)  # type: ignore[method-assign]
    train_with_a_nan(smooth, out, 4, 2)

if __name__ == "__main__":
    main(sys.argv[1], "--no-kill" not in sys.argv[2:])
