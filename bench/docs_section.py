"""What the benchmarks share: writing one section of docs/PERFORMANCE.md (leaving the others alone),
and dropping a store from the page cache for cold measurements."""

from __future__ import annotations

import os
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
