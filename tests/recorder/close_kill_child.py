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


@recorder.paper_step("Eq. 2", description="softplus")
def smooth(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.softplus(x)


def main(out: str, kill: bool) -> None:
    if kill:
        writer.StoreWriter._publish_final = lambda self: os.kill(os.getpid(), signal.SIGKILL)  # type: ignore[method-assign]
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with recorder.record(out, model=model, optimizer=opt):
        for i in range(4):
            x = torch.randn(2, 4)
            if i == 2:
                x[0, 0] = float("nan")
            smooth(model(x)).sum().backward()
            opt.step()
            opt.zero_grad()


if __name__ == "__main__":
    main(sys.argv[1], "--no-kill" not in sys.argv[2:])
