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


def rewrite_docs(path: Path, change: Any, rank: int = 0) -> None:
    """Replace documents of a recording (``change(index, parsed) -> new value``, or None to keep one),
    the document arrays and the manifest's lengths rewritten to match, as a forger would."""
    import numpy as np
    import zarr

    group = zarr.open_group(path, mode="r+")[layout.rank_group(rank)]
    offsets, lengths = group["docs/offset"][:], group["docs/length"][:]
    raw = group["docs/bytes"][:].tobytes()
    docs = []
    for i, (start, size) in enumerate(zip(offsets.tolist(), lengths.tolist())):
        old = raw[start:start + size]
        new = change(i, json.loads(old))
        docs.append(old if new is None else new if isinstance(new, bytes) else json.dumps(new).encode())
    sizes = np.array([len(d) for d in docs], dtype=np.int64)
    data = np.frombuffer(b"".join(docs), dtype=np.uint8)
    for name, values in (("docs/bytes", data), ("docs/offset", np.concatenate([[0], np.cumsum(sizes)[:-1]])),
                         ("docs/length", sizes)):
        group[name].resize((len(values),))
        group[name][:] = values.astype(group[name].dtype)
    manifest_path = path / layout.manifest_key(rank)
    manifest = json.loads(manifest_path.read_text())
    manifest["ranks"][str(rank)].update({"docs": len(sizes), "docs/bytes": len(data)})
    write_sealed(manifest_path, manifest)


def as_schema(path: Path, version: str, without: tuple[str, ...] = ()) -> None:
    """Make a recording made now read as one of another schema (an older version's, or a newer minor's): every
    manifest and our attributes of the root and rank groups stamped ``version``, checksums recomputed, and the
    arrays ``without`` (``"steps/flags"``, which the first 1.2 recordings lack) removed, with the length of a table
    left with no array. What else the older schema recorded otherwise is the test's to rewrite."""
    import shutil

    for meta_path in [path / "zarr.json", *sorted(path.glob("rank*/zarr.json"))]:
        meta = json.loads(meta_path.read_text())
        ours = meta.get("attributes", {}).get(layout.ATTRS_KEY)
        if isinstance(ours, dict):
            if "schema_version" in ours:
                ours["schema_version"] = version
            write_sealed(meta_path, meta)
    for manifest_path in [path / layout.MANIFEST_KEY, *sorted(path.glob(f"rank*/{layout.MANIFEST_KEY}"))]:
        if not manifest_path.is_file():
            continue
        manifest = json.loads(manifest_path.read_text())
        manifest["schema_version"] = version
        for group in sorted(path.glob("rank*")):
            lengths = manifest["ranks"].get(group.name.removeprefix("rank"))
            for array in without:
                shutil.rmtree(group / array, ignore_errors=True)
                table = array.split("/")[0]
                if lengths is not None and not any((group / table).glob("*/zarr.json")):
                    lengths.pop(table, None)
        write_sealed(manifest_path, manifest)


def as_plain_dicts(index: int, doc: Any) -> Any:
    """For ``rewrite_docs``: a document as schema 1.12 and older kept it, every dict subclass ($mapping) a
    plain dict of its items; None for a document without one."""
    def plain(value: Any) -> Any:
        if isinstance(value, list):
            return [plain(v) for v in value]
        if not isinstance(value, dict):
            return value
        if set(value) == {"$mapping"}:
            return {k: plain(v) for k, v in value["$mapping"]["items"]}
        return {k: plain(v) for k, v in value.items()}

    return plain(doc) if "$mapping" in json.dumps(doc) else None
