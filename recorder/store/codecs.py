"""Compression settings: one Blosc configuration, known to both zarr (for readers) and numcodecs
(for the writer, which encodes whole chunks itself to avoid zarr's per-call overhead)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import google_crc32c
import numcodecs
import numpy as np
from zarr.codecs import BloscCodec, Crc32cCodec

from ..errors import RecordingError

_SHUFFLES = {"noshuffle": numcodecs.Blosc.NOSHUFFLE, "shuffle": numcodecs.Blosc.SHUFFLE,
             "bitshuffle": numcodecs.Blosc.BITSHUFFLE}
_CNAMES = ("lz4", "lz4hc", "zstd", "zlib", "blosclz")


@dataclass(frozen=True)
class Compression:
    """A Blosc configuration, or none at all (``cname=None``)."""

    cname: str | None = "lz4"
    clevel: int = 5
    shuffle: str = "bitshuffle"
    # Payloads by default: once a whole chunk shrinks by less than MIN_RATIO (float activations and
    # gradients shrink ~1.13x for ~1 GB/s of one core), the next chunks are stored as uncompressed
    # Blosc frames (a copy; every Blosc reader decodes them as it does any frame), and every
    # RETEST-th whole chunk is compressed again to see whether the data changed.
    adaptive: bool = False
    # Schema 1.5: zarr's crc32c codec after Blosc, so that any change to a stored chunk is an error on
    # read (index and document chunks; payload bytes have their own content hash).
    checksum: bool = False
    # The Blosc codec of a partial last chunk while the run goes on (re-encoded at every commit; the
    # whole chunks, and the last one at close, use ``cname``); None: ``cname`` for every chunk.
    partial_cname: str | None = None

    def zarr_codecs(self) -> list[Any]:
        """The bytes-to-bytes codecs of an array stored with this configuration, in order."""
        out: list[Any] = [] if self.cname is None else [
            BloscCodec(cname=self.cname, clevel=self.clevel, shuffle=self.shuffle)]
        return [*out, Crc32cCodec()] if self.checksum else out

    def encode(self, chunk: np.ndarray, *, partial: bool = False) -> bytes:
        """Encode one whole chunk exactly as zarr would store it (C order, little endian);
        ``partial``: a chunk that the next commit encodes again (``partial_cname``, if any)."""
        data = np.ascontiguousarray(chunk)
        if self.cname is None:
            return self._sealed(data.tobytes())
        cname = self.partial_cname if partial and self.partial_cname else self.cname
        codec = numcodecs.Blosc(cname=cname, clevel=self.clevel, shuffle=_SHUFFLES[self.shuffle])
        return self._sealed(bytes(codec.encode(data)))

    def encode_stored(self, chunk: np.ndarray) -> bytes:
        """The chunk as an uncompressed frame of the same codec (Blosc at level 0 copies it)."""
        data = np.ascontiguousarray(chunk)
        if self.cname is None:
            return self._sealed(data.tobytes())
        frame = numcodecs.Blosc(cname=self.cname, clevel=0, shuffle=numcodecs.Blosc.NOSHUFFLE).encode(data)
        return self._sealed(bytes(frame))

    def _sealed(self, data: bytes) -> bytes:
        """``data`` followed by its crc32c (little endian), as zarr's crc32c codec stores it."""
        return data + np.uint32(google_crc32c.value(data)).tobytes() if self.checksum else data

    @classmethod
    def described(cls, doc: dict[str, Any]) -> Compression:
        """The configuration ``describe()`` wrote (a run's ``compression`` attribute)."""
        return cls(doc.get("cname"), int(doc.get("clevel", 5)), doc.get("shuffle", "bitshuffle"),
                   adaptive="adaptive" in doc)

    def describe(self) -> dict[str, Any]:
        if self.cname is None:  # compressor="none": no Blosc, so no level or shuffle either
            return {"cname": None}
        out: dict[str, Any] = {"cname": self.cname, "clevel": self.clevel, "shuffle": self.shuffle}
        if self.adaptive:
            out["adaptive"] = {"min_ratio": MIN_RATIO, "retest_every": RETEST}
        return out


MIN_RATIO = 1.25  # adaptive: a whole chunk must shrink at least this much to keep compressing
RETEST = 16  # adaptive: of the whole chunks stored uncompressed, every RETEST-th is compressed again

# Payloads: lz4 with bit shuffle was both the fastest and the best ratio on float activations; as
# those shrink only ~1.13x, poorly compressing chunks are stored as they are (adaptive).
DEFAULT_PAYLOADS = Compression("lz4", 5, "bitshuffle", adaptive=True)
# Indexes and documents: their partial last chunk is re-encoded at every commit, so encoding speed
# counts (lz4 with byte shuffle: ~6x faster than zstd-3 on an 8192-row int64 column, 4.3 KB instead
# of 3.4 KB). Documents are zstd-1 all the same: most of their bytes are RNG states (the CPU
# generator's 5 KB, base64 in JSON, new at every step that draws random numbers), which lz4, with
# no entropy coding, leaves at 1.11x; zstd-1 makes them 2.25x (a 1 MB chunk of a stats-mode
# recording) for 3.8 ms of encoding instead of 1.0. The partial last chunk, encoded again at every
# commit, stays lz4 until it is whole (or the run ends): a Blosc frame names its own codec.
INDEX = Compression("lz4", 5, "shuffle", checksum=True)
DOCS = Compression("zstd", 1, "noshuffle", checksum=True, partial_cname="lz4")

PRESETS = {
    "lz4": Compression("lz4", 5, "bitshuffle"),  # asked for by name: every chunk compressed
    "zstd": Compression("zstd", 1, "bitshuffle"),
    "none": Compression(None),
}


def parse(spec: Any) -> Compression:
    """Turn the user's ``compressor=`` into a Compression.

    Args:
        spec: None (default: Blosc lz4 + bit shuffle), a preset name ("lz4", "zstd", "none"),
            a dict with ``cname``/``clevel``/``shuffle``, or a Compression.
    """
    if spec is None:
        return DEFAULT_PAYLOADS
    if isinstance(spec, Compression):
        return spec
    if isinstance(spec, str):
        if spec not in PRESETS:
            raise RecordingError(f"unknown compressor {spec!r}: use one of {', '.join(PRESETS)} or a dict "
                                 "with cname/clevel/shuffle")
        return PRESETS[spec]
    if isinstance(spec, dict):
        comp = Compression(spec.get("cname", "lz4"), int(spec.get("clevel", 5)), spec.get("shuffle", "bitshuffle"))
        if comp.cname not in _CNAMES or comp.shuffle not in _SHUFFLES or not 0 <= comp.clevel <= 9:
            raise RecordingError(f"invalid compressor {spec!r}: cname in {_CNAMES}, clevel 0-9, shuffle in "
                                 f"{tuple(_SHUFFLES)}")
        return comp
    raise RecordingError(f"compressor must be None, a preset name or a dict, not {type(spec).__name__}")
