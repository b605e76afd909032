"""Child process of test_torn_tail: records a small model in small chunks, commits, then SIGKILLs itself.

    python torn_child.py STORE ITERATIONS NAN_AT [--close | --commit-at K] [--pause-at P]

Rows per chunk are divided by 256 (32 steps per chunk of a step column) so that a short run seals several
chunks. Iteration ``NAN_AT`` gets a NaN in its input. After the last iteration the recording is committed
(``recorder.flush()``) and the process kills itself with SIGKILL, as the OOM killer would; ``--close``: the
recording is closed instead, and the process ends normally; ``--commit-at K``: committed after iteration ``K``
only, the iterations after it recorded and never committed. No other commit happens (``flush_interval`` of an
hour): what a death finds committed is known. ``--pause-at P``: after iteration ``P``, commit, print "committed"
and wait for a line on stdin (a reader reads the live recording meanwhile).
"""

from __future__ import annotations

import os
import signal
import sys

import torch

import recorder
from tests.recorder.crash_child import shrink_chunks, train_with_a_nan


@recorder.paper_step("Eq. 2", description="softplus")
def smooth(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.softplus(x)


def main(out: str, iterations: int, nan_at: int, close: bool, commit_at: int | None,
         pause_at: int | None = None) -> None:
    shrink_chunks(256)

    def after(i: int) -> None:
        if i == commit_at:
            assert recorder.flush(), "the recording did not commit"
        if i == pause_at:
            assert recorder.flush(), "the recording did not commit"
            print("committed", flush=True)
            sys.stdin.readline()
        if i == iterations - 1 and not close:
            if commit_at is None:
                assert recorder.flush(), "the recording did not commit"
            os.kill(os.getpid(), signal.SIGKILL)

    train_with_a_nan(smooth, out, iterations, nan_at, after=after, modules="**", flush_interval=3600)


if __name__ == "__main__":
    rest = sys.argv[4:]
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), "--close" in rest,
         int(rest[rest.index("--commit-at") + 1]) if "--commit-at" in rest else None,
         int(rest[rest.index("--pause-at") + 1]) if "--pause-at" in rest else None)
