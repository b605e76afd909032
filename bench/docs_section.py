"""What the benchmarks share: writing one section of docs/PERFORMANCE.md (leaving the others alone),
dropping a store from the page cache for cold measurements, running with a given number of torch
threads, alternating one recording session between paused and resumed, and judging a measured ratio
against its target with the spread of the measurement."""

from __future__ import annotations

import contextlib
import os
import random
import statistics
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
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


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """``env`` added to this process's environment inside the block (for the processes started
    there), the previous values put back after it."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, old in saved.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old


def median_interval(values: list[float], level: float = 0.95, resamples: int = 4000,
                    seed: int = 0) -> tuple[float, float]:
    """Percentile-bootstrap interval of the median of ``values`` (the same seed gives the same
    interval for the same values). With rounds paired against a baseline, this is how far the
    median ratio could be from the one measured, given how much the rounds disagree."""
    if len(values) < 2:
        return values[0], values[0]
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    cut = int((1 - level) / 2 * resamples)
    return medians[cut], medians[resamples - 1 - cut]


def judge(interval: tuple[float, float], limit: float) -> str:
    """"met" when the whole interval is within ``limit``, "not met" when all of it is above, and
    "undecided" when it spans the limit: on that machine, in that run, the measurement cannot tell."""
    low, high = interval
    if high <= limit:
        return "met"
    if low > limit:
        return "not met"
    return "undecided"


def paused_and_resumed(run: Any, rounds: int, block: Callable[[bool], T]) -> tuple[list[T], list[T]]:
    """Blocks of one recording session alternating between paused and resumed, the order swapping
    every round: ``block(recorded)`` runs one (a recorded block should end with ``run.flush()``, so
    that the writer's work is inside it). Returns the paused blocks' results and the recorded ones',
    paired by round; the session is left resumed."""
    paused: list[T] = []
    recorded: list[T] = []
    run.pause()
    for r in range(rounds):
        for on in ((False, True) if r % 2 == 0 else (True, False)):
            if on:
                run.resume()
                recorded.append(block(True))
                run.pause()
            else:
                paused.append(block(False))
    run.resume()
    return paused, recorded


def rotated(items: list[T], r: int) -> list[T]:
    """``items`` in round ``r``'s order: round-robin, starting one further each round, so that no
    variant always runs first (drift and background load spread over all of them)."""
    k = r % len(items)
    return items[k:] + items[:k]


def paired(values: list[float], baseline: list[float]) -> list[float]:
    """Each round's value over the baseline's of the same round: drift between rounds cancels."""
    return [v / b for v, b in zip(values, baseline, strict=True)]


def judged(ratios: list[float], limit: float) -> tuple[float, tuple[float, float], str]:
    """The median of paired ratios, its 95% interval, and the verdict against ``limit``."""
    interval = median_interval(ratios)
    return statistics.median(ratios), interval, judge(interval, limit)


def interval_text(interval: tuple[float, float]) -> str:
    """An interval as verdict lines print it: three decimals, so that an end just past a target
    does not read as the target itself."""
    return f"{interval[0]:.3f}–{interval[1]:.3f}"
