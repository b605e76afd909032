"""Reading a recording back as the recorder's tests check it (no replayer)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from recorder import snapshot
from recorder.store.reader import RunReader


def rng_parts(rank: Any, step: int) -> dict[str, Any]:
    """A step's recorded generator states, decoded: {"torch": uint8 tensor, "numpy": ..., ...}."""
    ids = rank.doc(int(rank.column("steps/rng")[step]))
    return {name: snapshot.decode_rng_part(name, rank.doc(doc_id)) for name, doc_id in ids.items()}


def raw(t: torch.Tensor) -> bytes:
    """A tensor's bytes, for bitwise comparison."""
    return bytes(t.contiguous().view(-1).view(torch.uint8).numpy())


def step_rows(path: Path) -> list[dict[str, Any]]:
    """Every step of rank 0: its identity, links and status, and every tensor record with its bytes
    (sorted), for comparing two recordings step for step and bit for bit."""
    rank = RunReader(path).rank(0)
    out = []
    for i in range(len(rank)):
        col = lambda n: int(rank.column(f"steps/{n}")[i])  # noqa: E731
        out.append({
            "name": rank.doc(col("name")), "path": rank.doc(col("module_path")), "phase": col("phase"),
            "iteration": col("iteration"), "call": col("call"), "parent": col("parent"),
            "forward": col("forward"), "status": col("status"),
            "tensors": sorted((r.role, r.name, r.dtype, r.shape, raw(rank.tensor(r))) for r in rank.tensor_records(i))})
    return out

