"""Checks a zipped recording (a failure bundle from someone else) before zarr is allowed near it.

Opening a bundle must never run code from it. zarr would decode any codec it knows, and numcodecs
registers ``numcodecs.pickle`` (unpickling runs code), so every array's metadata is read here first
and only the codecs and data types PaperDebugger writes are accepted. Member names, duplicates,
declared array sizes and the total size are checked too: a few hundred bytes of JSON can declare an
8 TB array.
"""

from __future__ import annotations

import json
import math
import re
import zipfile
import zlib
from pathlib import Path, PurePosixPath

from ..errors import FormatError, NotARecordingError

MAX_TOTAL_BYTES = 64 << 30  # everything the zip holds, uncompressed
MAX_DECLARED_BYTES = 64 << 30  # all arrays' declared shapes together
MAX_METADATA_BYTES = 1 << 20  # one zarr.json or other JSON member
# What the recorder writes: raw bytes or Blosc, with a crc32c. Blosc's header gives a chunk's decoded
# size before it is decoded; a gzip or zstd stream's does not, and 2 MB of gzip decode to 2 GB.
ALLOWED_CODECS = frozenset({"bytes", "blosc", "crc32c"})
ALLOWED_DTYPES = {"bool": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "uint8": 1, "uint16": 2,
                  "uint32": 4, "uint64": 8, "float16": 2, "float32": 4, "float64": 8}
_TOP = frozenset({"zarr.json", "manifest.json", "bundle.json", "recipes.json"})
_MEMBER = re.compile(r"^rank\d+(/[A-Za-z0-9_.]+)*$")
_V2_KEYS = frozenset({".zarray", ".zattrs", ".zgroup", ".zmetadata"})


def _refuse(path: Path, why: str) -> FormatError:
    return FormatError(f"{path}: refused: {why}; this is not a recording PaperDebugger wrote, or it was altered")


def check_zip(path: str | Path) -> None:
    """Raise FormatError (one line) unless ``path`` is a zip that holds only what a recording holds."""
    path = Path(path)
    try:  # is_zipfile() takes a file it cannot open (too many open files, no permission) for no zip
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise FormatError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if not zipfile.is_zipfile(path):
        raise NotARecordingError(f"{path} is not a PaperDebugger recording (neither a recording directory nor a "
                                 "zip: a truncated bundle or another kind of file); give the path of a recording")
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        raise _refuse(path, "not a valid zip file (truncated or damaged)") from None
    except OSError as exc:
        raise FormatError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    with archive:
        infos = archive.infolist()
        names = [i.filename for i in infos]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise _refuse(path, f"member {dup!r} appears more than once")
        total = 0
        for info in infos:
            _check_name(path, info.filename)
            if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
                raise _refuse(path, f"member {info.filename!r} uses an unsupported zip compression")
            total += info.file_size
        if total > MAX_TOTAL_BYTES:
            raise _refuse(path, f"it unpacks to {total} bytes, more than the {MAX_TOTAL_BYTES} allowed")
        if "zarr.json" not in names:
            raise _refuse(path, "it has no zarr.json at its root")
        declared = 0
        for info in infos:
            name = info.filename
            if not (name == "zarr.json" or name.endswith("/zarr.json") or name in _TOP):
                continue
            if info.file_size > MAX_METADATA_BYTES:
                raise _refuse(path, f"{name} is {info.file_size} bytes, too large for metadata")
            try:
                doc = json.loads(archive.read(info))
            except (ValueError, UnicodeDecodeError):
                raise _refuse(path, f"{name} is not valid JSON") from None
            except (zipfile.BadZipFile, OSError, EOFError, zlib.error) as exc:  # zlib: a damaged deflated member
                raise _refuse(path, f"{name} cannot be read ({exc})") from None
            if name.endswith("zarr.json"):
                declared += _check_node(path, name, doc)
        if declared > MAX_DECLARED_BYTES:
            raise _refuse(path, f"its arrays declare {declared} bytes, more than the {MAX_DECLARED_BYTES} allowed")
        try:
            bad = archive.testzip()
        except (zipfile.BadZipFile, OSError, EOFError, zlib.error) as exc:
            raise _refuse(path, f"it cannot be read to the end ({exc})") from None
        if bad is not None:
            raise _refuse(path, f"member {bad!r} is damaged (CRC mismatch)")


def _check_name(path: Path, name: str) -> None:
    pure = PurePosixPath(name)
    if name.startswith("/") or "\\" in name or ".." in pure.parts or ":" in name or not name:
        raise _refuse(path, f"member name {name!r} points outside the bundle")
    if name.endswith("/"):  # directory entries are harmless but not something we write
        raise _refuse(path, f"unexpected directory entry {name!r}")
    if pure.name in _V2_KEYS:
        raise _refuse(path, f"member {name!r} is zarr v2 metadata, which PaperDebugger never writes")
    if name not in _TOP and not _MEMBER.match(name):
        raise _refuse(path, f"unexpected member {name!r}")


def _check_node(path: Path, name: str, doc: object) -> int:
    """Check one node's metadata; returns the bytes its array declares (0 for groups)."""
    if not isinstance(doc, dict) or doc.get("zarr_format") != 3:
        raise _refuse(path, f"{name} is not zarr v3 metadata")
    kind = doc.get("node_type")
    if kind == "group":
        return 0
    if kind != "array":
        raise _refuse(path, f"{name} declares node type {kind!r}")
    dtype = doc.get("data_type")
    if not isinstance(dtype, str) or dtype not in ALLOWED_DTYPES:  # a list or dict is not hashable
        raise _refuse(path, f"{name} declares data type {dtype!r}, which a recording never holds")
    codecs = doc.get("codecs")
    if not isinstance(codecs, list) or not codecs:
        raise _refuse(path, f"{name} lists no codecs")
    for codec in codecs:
        codec_name = codec.get("name") if isinstance(codec, dict) else codec
        if not isinstance(codec_name, str) or codec_name not in ALLOWED_CODECS:
            raise _refuse(path, f"{name} uses codec {codec_name!r}; only {', '.join(sorted(ALLOWED_CODECS))} are "
                                "accepted")
    for key in ("storage_transformers",):
        if doc.get(key):
            raise _refuse(path, f"{name} declares {key}, which PaperDebugger never writes")
    shape = doc.get("shape")
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                              for n in shape):
        raise _refuse(path, f"{name} declares a malformed shape")
    grid = doc.get("chunk_grid")
    config = grid.get("configuration") if isinstance(grid, dict) else None
    chunks = config.get("chunk_shape") if isinstance(config, dict) else None
    if not isinstance(chunks, list) or len(chunks) != len(shape) or not all(
            isinstance(n, int) and not isinstance(n, bool) and 0 < n <= 1 << 31 for n in chunks):
        raise _refuse(path, f"{name} declares a malformed chunk shape")
    return math.prod(shape) * ALLOWED_DTYPES[dtype]
