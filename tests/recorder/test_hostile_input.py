"""Hostile and corrupted input: a real recording damaged one way at a time (a flipped byte, a
truncated or deleted file, an edited metadata field) reads back exactly as before or raises a
PaperDebugger error with a one-line message; never another exception, a hang, or a wrong value
(payload bytes carry their content hash, index and document chunks a crc32c, manifests and our
group attributes a checksum: schema 1.5)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numcodecs
import numpy as np
import pytest
import torch
import zarr
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

import recorder
from recorder.errors import ChecksumError, FormatError, PdbgError, SchemaVersionError
from recorder.store import backend, codecs, layout
from recorder.store.reader import RunReader
from tests.models import Tiny
from tests.sealing import write_sealed

BLOB_CHUNK = "rank0/blobs/u4/c/0"
ROOT_FILES = ("zarr.json", layout.MANIFEST_KEY)


def record_tiny(path: Path, iterations: int = 3) -> None:
    """A small full recording: a module step and a function step, forward and backward, with int64
    (indices) and float32 payloads, trained with SGD."""
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with recorder.record(path, model=model, optimizer=opt, mode="full") as run:
        for i in range(iterations):
            model(torch.arange(6).reshape(2, 3) + i).square().mean().backward()
            opt.step()
            opt.zero_grad()
    assert run.status == "complete" and run.failure is None


def read_all(path: Path) -> dict[str, Any]:
    """Everything a user reads from a recording, as comparable values: run information, every step
    row, every document, every tensor record with its statistics and value, every payload."""
    reader = RunReader(path)
    rank = reader.rank(0)
    info = {"run": reader.run_info, "final": reader.attrs.get("final"), "status": reader.status,
            "schema": reader.schema_version, "ranks": reader.ranks}
    data: dict[str, Any] = {f"steps/{c}": rank.column(f"steps/{c}").tobytes() for c in layout.STEP_COLUMNS}
    data["docs"] = [json.dumps(rank.doc(i), sort_keys=True) for i in range(rank.lengths["docs"])]
    records = []
    for step in range(len(rank)):
        for r in rank.tensor_records(step):
            value = rank.tensor(r).reshape(-1).view(torch.uint8).numpy().tobytes() if r.has_payload else None
            records.append((r.row, r.step, r.role, r.name, r.dtype, r.device, r.requires_grad, r.shape, r.stride,
                            np.array(list(r.stats.values())).tobytes(), r.payload, value))
    data["records"] = records
    data["payloads"] = [(units.tobytes(), unit) for units, unit in
                        (rank.payload_units(pid) for pid in range(rank.lengths["payloads"]))]
    return {"info": info, "data": data}


@dataclass(frozen=True)
class Recording:
    path: Path
    read: dict[str, Any] = field(repr=False)
    files: dict[str, int] = field(repr=False)  # path relative to the store -> size
    lengths: dict[str, int] = field(repr=False)  # the manifest's committed lengths of rank 0


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Recording:
    path = tmp_path_factory.mktemp("hostile") / "run.zarr"
    record_tiny(path)
    files = {p.relative_to(path).as_posix(): p.stat().st_size for p in sorted(path.rglob("*")) if p.is_file()}
    lengths = json.loads((path / layout.MANIFEST_KEY).read_text())["ranks"]["0"]
    return Recording(path, read_all(path), files, lengths)


def category(rel: str) -> str:
    """Which part of the recording a file is: root metadata, array metadata, or a column's chunk."""
    if rel in ROOT_FILES:
        return "root"
    if rel.endswith("zarr.json"):
        return "array metadata"
    return rel.split("/")[1]  # steps, tensors, payloads, docs, dims, late, blobs


@dataclass(frozen=True)
class Mutation:
    kind: str  # flip, truncate, delete, edit
    file: str
    arg: Any = None  # flip: (offset, xor); truncate: new length; edit: (where, value), see edit()

    def apply(self, store: Path) -> None:
        target = store / self.file
        if self.kind == "delete":
            target.unlink()
        elif self.kind == "truncate":
            target.write_bytes(target.read_bytes()[:self.arg])
        elif self.kind == "flip":
            raw = bytearray(target.read_bytes())
            raw[self.arg[0]] ^= self.arg[1]
            target.write_bytes(bytes(raw))
        else:
            doc = json.loads(target.read_text())
            edit(doc, *self.arg)
            target.write_text(json.dumps(doc))


def edit(doc: Any, where: str, value: Any) -> None:
    """Set (or, with DELETE, remove) one field of a metadata document. ``where`` is a path of keys
    separated by "/", or "ranks.0.<key>" for one of the manifest's lengths (their keys contain "/");
    a callable value computes the new value from the old."""
    if where.startswith("ranks.0."):
        key = where.removeprefix("ranks.0.")
        if value is DELETE:
            del doc["ranks"]["0"][key]
        else:
            doc["ranks"]["0"][key] = value(doc["ranks"]["0"][key]) if callable(value) else value
        return
    *parents, last = (int(k) if k.isdigit() else k for k in where.split("/"))
    for key in parents:
        doc = doc[key]
    if value is DELETE:
        del doc[last]
    else:
        doc[last] = value(doc[last]) if callable(value) else value


DELETE = object()
ANY_VERSION = ["1.0", "1.9", "2.0", "0.9", "x", 12, None]
PD = "attributes/paperdebugger"
ROOT_EDITS = [(f"{PD}/schema_version", v) for v in ANY_VERSION] + [
    (f"{PD}/format", "other"), (f"{PD}/run", []), (f"{PD}/final", "x"), ("attributes", []), (PD, DELETE),
    ("zarr_format", 2), ("node_type", "array")]
MANIFEST_EDITS = [("schema_version", v) for v in ANY_VERSION] + [("status", v) for v in (
    "recording", "crashed", "banana", 3, None)] + [
    ("format", "other"), ("ranks", []), ("ranks", {}), ("writer", "x"), ("updated_unix", "soon"), ("seq", DELETE)]
LENGTH_EDITS = [lambda n: n + 1, lambda n: n - 1, lambda n: 0, -1, "12", None, 10 ** 18, True, DELETE]
ARRAY_EDITS = [("shape/0", f) for f in (lambda n: n + 1, lambda n: n - 1, lambda n: 0, lambda n: n * 1000, -1)] + [
    ("data_type", d) for d in ("int8", "int32", "int64", "uint64", "float64", "bool", "complex64")] + [
    ("chunk_grid/configuration/chunk_shape/0", f) for f in (lambda c: 1, lambda c: c // 2, lambda c: 2 * c,
                                                            lambda c: 1 << 40)] + [
    ("codecs", lambda codecs: codecs[:1]), ("codecs/0/configuration/endian", "big"),
    ("chunk_key_encoding/configuration/separator", "."), ("node_type", "group"), ("zarr_format", 2),
    ("fill_value", 7), ("shape", DELETE)]


@st.composite
def mutations(draw: Any, rec: Recording) -> Mutation:
    """One damage to one file; files are drawn by part first, so a small part is not swamped by
    the many small chunk files."""
    kind = draw(st.sampled_from(["flip", "flip", "truncate", "delete", "edit"]))
    if kind == "edit":
        target = draw(st.sampled_from(["zarr.json", layout.MANIFEST_KEY, "array"]))
        if target == "zarr.json":
            return Mutation(kind, target, draw(st.sampled_from(ROOT_EDITS)))
        if target == layout.MANIFEST_KEY:
            key = draw(st.sampled_from([*sorted(rec.lengths), "other"]))
            if key == "other":
                return Mutation(kind, target, draw(st.sampled_from(MANIFEST_EDITS)))
            return Mutation(kind, target, (f"ranks.0.{key}", draw(st.sampled_from(LENGTH_EDITS))))
        arrays = sorted(f for f in rec.files if category(f) == "array metadata" and f.count("/") == 3)
        return Mutation(kind, draw(st.sampled_from(arrays)), draw(st.sampled_from(ARRAY_EDITS)))
    part = draw(st.sampled_from(sorted({category(f) for f in rec.files})))
    rel = draw(st.sampled_from(sorted(f for f in rec.files if category(f) == part)))
    size = rec.files[rel]
    if kind == "delete":
        return Mutation(kind, rel)
    if kind == "truncate":
        return Mutation(kind, rel, draw(st.integers(0, size - 1)))
    return Mutation(kind, rel, (draw(st.integers(0, size - 1)), draw(st.integers(1, 255))))


def check_outcome(pristine: Recording, store: Path, mutation: Mutation) -> str:
    """Read the damaged store: an error must be ours, in one line; a read must be the pristine one
    (data always, run metadata unless the mutation edited it), unless the format cannot tell."""
    try:
        got = read_all(store)
    except PdbgError as exc:
        text = str(exc)
        assert text and "\n" not in text, f"{type(exc).__name__} message is not one non-empty line: {text!r}"
        return type(exc).__name__
    assert got["data"] == pristine.read["data"], "wrong values read as if they were right"
    assert got["info"] == pristine.read["info"], "wrong run information read as if it were right"
    return "read"


@pytest.mark.timeout(300)
@settings(max_examples=120, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_damaged_recording_reads_right_or_fails_clearly(pristine: Recording, data: Any) -> None:
    """Any single damage: the same read, or a PaperDebugger error with a one-line message."""
    mutation = data.draw(mutations(pristine))
    note(f"mutation: {mutation}")
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "run.zarr"
        shutil.copytree(pristine.path, store)
        mutation.apply(store)
        outcome = check_outcome(pristine, store, mutation)
    event(f"{mutation.kind} {category(mutation.file)}: {outcome}")


# -- one test per kind of damage, so that a regression names itself ----------------------------------
@pytest.fixture
def damaged(pristine: Recording, tmp_path: Path) -> Path:
    """A fresh copy of the pristine recording, to damage."""
    store = tmp_path / "run.zarr"
    shutil.copytree(pristine.path, store)
    return store


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert text and "\n" not in text
    return text


def test_a_missing_chunk_inside_the_committed_rows_is_an_error_not_zeros(damaged: Path) -> None:
    """zarr reads a chunk that is not there as its fill value; the reader refuses instead."""
    (damaged / "rank0/steps/iteration/c/0").unlink()
    with pytest.raises(FormatError) as err:
        RunReader(damaged).rank(0).column("steps/iteration")
    assert "chunk rank0/steps/iteration/c/0 is missing" in one_line(err.value)


def test_a_missing_payload_chunk_is_an_error_not_zeros(damaged: Path) -> None:
    (damaged / BLOB_CHUNK).unlink()
    rank = RunReader(damaged).rank(0)
    record = next(r for r in rank.tensor_records(0) if r.dtype == "float32" and r.has_payload)
    with pytest.raises(FormatError) as err:
        rank.tensor(record)
    assert f"chunk {BLOB_CHUNK} is missing" in one_line(err.value)


def test_payload_bytes_that_decode_to_other_values_fail_their_checksum(damaged: Path) -> None:
    """A payload chunk holding other bytes, validly compressed (what a flipped byte can decode to),
    is caught by the payload's recorded hash, and the message names the tensor."""
    chunk = damaged / BLOB_CHUNK
    units = np.frombuffer(numcodecs.Blosc().decode(chunk.read_bytes()), dtype=np.uint32).copy()
    units[0] ^= 1
    chunk.write_bytes(codecs.DEFAULT_PAYLOADS.encode(units))
    rank = RunReader(damaged).rank(0)
    with pytest.raises(ChecksumError) as err:
        for step in range(len(rank)):
            for record in rank.tensor_records(step):
                if record.has_payload:
                    rank.tensor(record)
    text = one_line(err.value)
    assert "payload checksum mismatch: the recording is corrupted" in text
    assert "tensor '" in text and "of step" in text and "blobs/u4" in text


def test_a_flipped_byte_in_a_payload_chunk_is_detected(damaged: Path) -> None:
    """A flip inside the compressed payload bytes fails to decode or fails the checksum."""
    chunk = damaged / BLOB_CHUNK
    raw = bytearray(chunk.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    chunk.write_bytes(bytes(raw))
    with pytest.raises(FormatError) as err:
        read_all(damaged)
    assert "blobs/u4" in one_line(err.value)


@pytest.mark.parametrize("chunk", ["rank0/tensors/stats/c/0/0", BLOB_CHUNK, "rank0/docs/bytes/c/0"])
@pytest.mark.parametrize("keep", [-7, 9])
def test_a_truncated_chunk_is_an_error(damaged: Path, chunk: str, keep: int) -> None:
    """Blosc has no length check of its own: a cut chunk could decode from bytes past its end. One
    cut inside its 16-byte header is said to be (not "a header that declares None bytes")."""
    path = damaged / chunk
    path.write_bytes(path.read_bytes()[:keep])
    with pytest.raises(FormatError) as err:
        read_all(damaged)
    text = one_line(err.value)
    assert f"chunk {chunk} is truncated or damaged" in text and "None" not in text
    assert ("shorter than the 16-byte Blosc header" in text) == (keep == 9)


def test_a_truncated_manifest_is_an_error(damaged: Path) -> None:
    manifest = damaged / layout.MANIFEST_KEY
    manifest.write_bytes(manifest.read_bytes()[:60])
    with pytest.raises(FormatError) as err:
        RunReader(damaged)
    assert "manifest.json is truncated or corrupt" in one_line(err.value)


def test_a_garbled_zarr_json_is_an_error(damaged: Path) -> None:
    root = damaged / "zarr.json"
    root.write_bytes(b"\x00\xff" + root.read_bytes()[2:])
    with pytest.raises(FormatError) as err:
        RunReader(damaged)
    assert "zarr.json is truncated or corrupt" in one_line(err.value)


def test_a_garbled_array_zarr_json_is_an_error(damaged: Path) -> None:
    meta = damaged / "rank0/steps/iteration/zarr.json"
    meta.write_text(meta.read_text().replace('"shape"', '"shap"'))
    with pytest.raises(FormatError) as err:
        RunReader(damaged).rank(0).column("steps/iteration")
    assert "rank0/steps/iteration/zarr.json is damaged" in one_line(err.value)


@pytest.mark.parametrize(("where", "value", "message"), [
    ("data_type", "int32", "declares data type int32"),
    ("codecs/0/configuration/endian", "big", "big endian"),
    ("chunk_grid/configuration/chunk_shape/0", 1 << 40, "in chunks of"),
])
def test_array_metadata_that_would_misread_the_chunks_is_refused(damaged: Path, where: str, value: Any,
                                                                 message: str) -> None:
    meta = damaged / "rank0/steps/iteration/zarr.json"
    doc = json.loads(meta.read_text())
    edit(doc, where, value)
    meta.write_text(json.dumps(doc))
    with pytest.raises(FormatError) as err:
        RunReader(damaged).rank(0).column("steps/iteration")
    assert message in one_line(err.value)


@pytest.mark.parametrize(("column", "row", "value", "message"), [
    ("tensors/role", 0, 11, "tensors/role row 0 holds 11 (allowed: 0..10)"),
    ("tensors/role", 0, -1, "tensors/role row 0 holds -1"),  # would read as the last role
    ("tensors/payload", 0, 10 ** 6, "tensors/payload row 0 holds 1000000"),
    ("tensors/name", 0, 10 ** 6, "tensors/name row 0 holds 1000000"),
    ("tensors/dims_start", 0, -2, "tensors/dims_start row 0 holds -2"),
    ("tensors/step", 0, 3, "belong to another step"),
    ("steps/parent", 1, -7, "steps/parent row 1 holds -7"),
    # a parent that began after its child: a cycle of parents hung pdbg info and the TUI, following it
    ("steps/parent", 1, 1, "step 1 names step 1 as the step it ran inside, which began after it"),
    ("steps/forward", 0, 3, "step 0 is not a step the recorder wrote (its rows read as zeros)"),
    ("steps/tensor_start", 0, 10 ** 6, "step 0 points past the committed tensor records"),
    ("payloads/offset", 0, 10 ** 9, "payload 0 (tensor 'args.0' of step 0) points past the committed data"),
    ("payloads/count", 0, -3, "payload 0 (tensor 'args.0' of step 0) points past the committed data"),
    ("payloads/blob", 0, 7, "payloads/blob row 0 holds 7"),
    ("docs/length", 0, 10 ** 7, "document 0 points past the committed data"),
])
def test_out_of_range_index_values_are_errors(damaged: Path, column: str, row: int, value: int, message: str) -> None:
    """Index values that point outside their table (written with valid compression, as a flip
    can decode to) are refused where they are read, never wrapped around or followed."""
    zarr.open_array(damaged / "rank0" / column, mode="r+")[row] = value
    with pytest.raises(FormatError) as err:
        read_all(damaged)
    assert message in one_line(err.value)


@pytest.mark.parametrize(("key", "value", "message"), [
    ("steps", -1, "invalid length steps=-1"),
    ("steps", "12", "invalid length steps='12'"),
    ("steps", 11, "array steps/name has 12 rows but 11 are committed"),  # a closed run's arrays are trimmed
    ("docs/bytes", 13, "array docs/bytes has"),
])
def test_manifest_lengths_that_do_not_fit_the_arrays_are_errors(damaged: Path, key: str, value: Any,
                                                                message: str) -> None:
    manifest = damaged / layout.MANIFEST_KEY
    doc = json.loads(manifest.read_text())
    doc["ranks"]["0"][key] = value
    write_sealed(manifest, doc)
    with pytest.raises(FormatError) as err:
        read_all(damaged)
    assert message in one_line(err.value)


@pytest.mark.parametrize(("where", "value", "error", "message"), [
    ("status", "banana", FormatError, "unknown status 'banana'"),
    ("ranks", [], FormatError, "is not a PaperDebugger manifest"),
    ("schema_version", "2.0", SchemaVersionError, "upgrade paperdebugger"),
    ("schema_version", None, FormatError, "invalid schema version None"),
])
def test_malformed_manifest_fields_are_errors(damaged: Path, where: str, value: Any, error: type, message: str) -> None:
    manifest = damaged / layout.MANIFEST_KEY
    doc = json.loads(manifest.read_text())
    doc[where] = value
    write_sealed(manifest, doc)
    with pytest.raises(error) as err:
        read_all(damaged)
    assert message in one_line(err.value)


def test_a_zipped_recording_is_checked_the_same_way(pristine: Recording, tmp_path: Path) -> None:
    """The chunk checks work on a zip (a bundle) too: the intact zip reads the same; one without a
    chunk names it."""
    def pack(target: Path, skip: str = "") -> Path:
        with zipfile.ZipFile(target, "w", compression=zipfile.ZIP_STORED) as archive:
            for rel in pristine.files:
                if rel != skip:
                    archive.write(pristine.path / rel, rel)
        return target

    assert read_all(pack(tmp_path / "run.pdbg"))["data"] == pristine.read["data"]
    with pytest.raises(FormatError) as err:
        read_all(pack(tmp_path / "cut.pdbg", skip="rank0/tensors/stats/c/0/0"))
    assert "chunk rank0/tensors/stats/c/0/0 is missing" in one_line(err.value)


def test_keys_that_are_not_regular_files_or_too_large_are_refused(damaged: Path) -> None:
    """A downloaded directory whose manifest is a link to /dev/zero read until memory ran out, a FIFO
    blocked the open forever, and a 3 GB sparse file was read whole: each is refused before reading."""
    manifest = damaged / layout.MANIFEST_KEY
    manifest.unlink()
    manifest.symlink_to("/dev/zero")
    with pytest.raises(FormatError, match="manifest.json cannot be read .*manifest.json is not a regular file"):
        RunReader(damaged)
    manifest.unlink()
    os.mkfifo(manifest)
    with pytest.raises(FormatError, match="manifest.json is not a regular file"):
        RunReader(damaged)
    manifest.unlink()
    with open(manifest, "wb") as fh:
        fh.truncate(backend.MAX_JSON_BYTES + 1)
    with pytest.raises(FormatError, match=r"manifest.json holds 67,108,865 bytes, more than any recording's"):
        RunReader(damaged)


def test_a_payload_chunk_that_is_a_fifo_is_refused(damaged: Path) -> None:
    chunk = damaged / BLOB_CHUNK
    chunk.unlink()
    os.mkfifo(chunk)
    with pytest.raises(FormatError, match=f"chunk {BLOB_CHUNK} cannot be read .*is not a regular file"):
        read_all(damaged)


def test_chunks_of_a_codec_that_cannot_be_sized_before_decoding_are_refused(damaged: Path, tmp_path: Path) -> None:
    """gzip is a codec zarr knows: 2 MB of it decode to 2 GB (4.45 GB of memory from a 2 MB bundle).
    The recorder writes raw or Blosc chunks only, whose decoded size is known first."""
    meta_path = damaged / "rank0/blobs/u4/zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["codecs"] = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "gzip",
                                                                               "configuration": {"level": 1}}]
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(FormatError, match="lists the codecs BytesCodec, GzipCodec; a recording's chunks are raw or "
                                          "Blosc-compressed"):
        read_all(damaged)
    bundle = tmp_path / "bomb.pdbg"
    with zipfile.ZipFile(bundle, "w") as archive:
        for path in sorted(damaged.rglob("*")):
            if path.is_file():
                archive.write(path, str(path.relative_to(damaged)))
    with pytest.raises(FormatError, match="uses codec 'gzip'; only blosc, bytes, crc32c are accepted"):
        RunReader(bundle)
