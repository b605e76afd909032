"""Reading a recording back as the recorder's tests check it (no replayer)."""

from __future__ import annotations

from typing import Any

from recorder import snapshot


def rng_parts(rank: Any, step: int) -> dict[str, Any]:
    """A step's recorded generator states, decoded: {"torch": uint8 tensor, "numpy": ..., ...}."""
    ids = rank.doc(int(rank.column("steps/rng")[step]))
    return {name: snapshot.decode_rng_part(name, rank.doc(doc_id)) for name, doc_id in ids.items()}
