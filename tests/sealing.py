"""Writing a recording's metadata by hand, as a consistent edit would (a tool, a migration): with
the checksum recomputed, so that a test reaches the reader's checks behind it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from recorder.store import layout


def write_sealed(path: Path, doc: dict[str, Any]) -> None:
    """Write a manifest or a group's zarr.json, its checksum made to match the edited contents."""
    ours = doc.get("attributes", {}).get(layout.ATTRS_KEY) if isinstance(doc.get("attributes"), dict) else None
    target = ours if isinstance(ours, dict) else doc if isinstance(doc.get("ranks"), dict) else None
    if target is not None:
        target[layout.CHECKSUM_KEY] = layout.checksum(target)
    path.write_text(json.dumps(doc))
