"""After a hard crash of a flight recording: write out what the shared ring held (``pdbg record``).

The child process recording the script died without closing its recording: a signal (SIGSEGV or
SIGABRT from native code, the OOM killer's SIGKILL) or an ``os._exit``. What it committed is on disk;
the payloads of its last ``keep`` iterations are in the shared memory the parent still holds
(recorder.shmring). The parent appends those that committed tensor records wait for, after the rank's
committed lengths (``StoreWriter.resume``): payload bytes and rows, then ``late/`` rows tying each
record to its payload, then closes the run ``crashed`` with the reason and what was recovered in the
final metadata (``died``, ``ring_recovered``).

Lost, and said so in ``ring_recovered``: records committed after nothing (steps after the last commit,
at most ``flush_interval`` before the death), payloads the child held outside shared memory
(``unshared_payloads``), and any entry whose bytes do not hash to its key (``damaged``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
from zarr.storage import LocalStore

from . import payload as payload_mod
from . import shmring
from .store import layout
from .store.writer import StoreWriter


def committed(out: str | Path, rank: int = 0) -> dict[str, Any] | None:
    """The rank's manifest (its ``status`` is ``recording`` while the recording is open), or None
    when there is no readable one."""
    try:
        manifest = json.loads((Path(out) / layout.manifest_key(rank)).read_bytes())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def recover(out: str | Path, ring: shmring.RingFile, died: str, rank: int = 0) -> dict[str, Any]:
    """Write the ring's payloads for the committed records of ``out`` and close it ``crashed``.

    Args:
        out: the recording's directory (the rank's manifest must say ``recording``).
        ring: the shared memory the dead child journaled its ring in.
        died: why the child ended, for the final metadata ("signal SIGABRT").
        rank: the rank the child recorded (a launcher's RANK, which it inherited).
    Returns what was recovered (also in the final metadata as ``ring_recovered``)."""
    writer = StoreWriter.resume(LocalStore(Path(out)), rank)
    tensors = writer.tensors
    late = {int(r) for r in writer.committed("late/tensor")}
    report: dict[str, Any] = {"payloads": 0, "reused_payloads": 0, "bytes": 0, "records": 0, "iterations": [],
                              "uncommitted_records": 0, "records_without_bytes": 0, "damaged": 0}
    iterations: set[int] = set()
    with shmring.read_journal(ring) as journal:
        for row, iteration, key in journal.rows:
            if row >= tensors:  # written after the last commit: the record itself is lost
                report["uncommitted_records"] += 1
                continue
            if row in late or iteration < journal.oldest:  # attached already / left the ring
                continue
            pid = writer.find_payload(key)
            if pid is not None:
                report["reused_payloads"] += 1
            else:
                units = journal.payloads.get(key)
                units = _empty(key) if units is None else units
                if units is None:
                    report["records_without_bytes"] += 1
                    continue
                if payload_mod.content_key(units, key[2]) != key:
                    report["damaged"] += 1
                    continue
                pid = writer.payload(key, units)  # encoded or copied into the writer's buffer at once
                report["payloads"] += 1
                report["bytes"] += int(units.nbytes)
            writer.late(row, pid)
            late.add(row)
            iterations.add(iteration)
            report["records"] += 1
        report["unshared_payloads"], report["journal_overflow"] = journal.unshared, journal.lost
        report["bad_entries"] = journal.bad
        del journal
    report["iterations"] = sorted(iterations)
    writer.close("crashed", {"died": died, "ended_unix": time.time(), "ring_recovered": report})
    return report


def _empty(key: tuple[int, int, int]) -> np.ndarray | None:
    """An empty tensor's payload (no bytes: never in shared memory), when that is what ``key`` names."""
    empty = payload_mod.units_of_bytes(np.zeros(0, dtype=np.uint8), key[2])
    return empty if payload_mod.content_key(empty, key[2]) == key else None

