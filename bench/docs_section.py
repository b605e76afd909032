"""What the benchmarks share: writing one section of docs/PERFORMANCE.md (leaving the others alone),
dropping a store from the page cache for cold measurements, and running with a given number of
torch threads."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs" / "PERFORMANCE.md"


def write_section(heading: str, text: str, docs: Path = DOCS) -> None:
    """Add ``text`` (which starts with the ``heading`` line) at the end of the file, or replace the
    section under that heading, up to the next ``## `` heading."""
    old = docs.read_text() if docs.exists() else ""
    lines = old.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.rstrip() == heading), None)
    if start is None:
        new = old.rstrip("\n") + ("\n\n" if old else "") + text
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        tail = "".join(lines[end:])
        new = "".join(lines[:start]) + text + ("\n" + tail if tail else "")
    docs.write_text(new)
    print(f"wrote {heading!r} in {docs}")


def evict(path: Path) -> None:
    """Drop the store's pages from the page cache (written back first, so that they are clean)."""
    for file in path.rglob("*"):
        if file.is_file():
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch on ``n`` intra-op threads inside the block, the previous number restored after it."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)
