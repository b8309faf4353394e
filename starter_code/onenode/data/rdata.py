"""Read character vectors out of an installed R package's lazy-load database, without R.

R stores a package's data sets in `data/Rdata.rdb` (one compressed, serialized R object per
variable) with an index `data/Rdata.rdx` (a gzipped, serialized list of byte offsets). This
reader understands just enough of R's XDR serialization format (R Internals, section 1.8) to
recover the character vectors that text packages such as janeaustenr ship.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import struct
import zlib
from pathlib import Path

# SEXP type codes from R's Rinternals.h, and the pseudo-types of the serialization stream.
_SYMSXP, _LISTSXP, _CHARSXP, _LGLSXP, _INTSXP, _REALSXP, _STRSXP, _VECSXP = 1, 2, 9, 10, 13, 14, 16, 19
_REFSXP, _NILVALUE_SXP = 255, 254


class RDataError(ValueError):
    """The bytes are not an R serialization this reader understands."""


class _Reader:
    def __init__(self, data: bytes):
        if data[:2] != b"X\n":
            raise RDataError("not an XDR (binary, big-endian) R serialization")
        self.data, self.pos, self.refs = data, 2, []
        version = self.int()
        self.pos += 8  # writer R version, minimal reader version
        if version == 3:
            encoding_length = self.int()  # then the native encoding's name
            self.pos += encoding_length
        elif version != 2:
            raise RDataError(f"unsupported R serialization version {version}")

    def int(self) -> int:
        (value,) = struct.unpack_from(">i", self.data, self.pos)
        self.pos += 4
        return value

    def length(self) -> int:
        n = self.int()
        if n == -1:  # long vector: two 32-bit halves
            hi, lo = self.int(), self.int()
            n = (hi << 32) + lo
        return n

    def item(self):
        flags = self.int()
        kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind == _NILVALUE_SXP:
            return None
        if kind == _REFSXP:
            index = flags >> 8 or self.int()
            return self.refs[index - 1]
        if kind == _SYMSXP:
            name = self.item()
            self.refs.append(name)
            return name
        if kind == _CHARSXP:
            n = self.int()
            if n == -1:
                return None  # NA_character_
            text = self.data[self.pos : self.pos + n].decode("utf-8", errors="replace")
            self.pos += n
            return text
        if kind == _LISTSXP:  # pairlist (attributes, tag, car, cdr), returned as {tag: car}
            if has_attr:
                self.item()  # a pairlist's own attributes carry nothing we need
            out = {}
            while True:
                tag = self.item() if has_tag else None
                out[tag] = self.item()
                nxt = self.int()
                kind, has_tag = nxt & 0xFF, nxt & (1 << 10)
                if kind == _NILVALUE_SXP:
                    return out
                if kind != _LISTSXP:
                    raise RDataError("malformed pairlist")
                if nxt & (1 << 9):
                    self.item()
        if kind in (_LGLSXP, _INTSXP):
            n = self.length()
            values = list(struct.unpack_from(f">{n}i", self.data, self.pos))
            self.pos += 4 * n
        elif kind == _REALSXP:
            n = self.length()
            values = list(struct.unpack_from(f">{n}d", self.data, self.pos))
            self.pos += 8 * n
        elif kind in (_STRSXP, _VECSXP):
            values = [self.item() for _ in range(self.length())]
        else:
            raise RDataError(f"unsupported R object type {kind}")
        attrs = self.item() if has_attr else {}
        names = attrs.get("names") if isinstance(attrs, dict) else None
        return dict(zip(names, values)) if names else values


def unserialize(data: bytes):
    """Decode one serialized R object: vectors become lists, named vectors dicts."""
    return _Reader(data).item()


def _decompress(record: bytes, method: int) -> bytes:
    # Record layout (R's lazyload): 4-byte big-endian output length, then the payload; methods
    # 2 and 3 add a one-byte marker ('Z' zlib, '2' bzip2, 'X' xz, '0' stored) before it.
    if method == 1:
        return zlib.decompress(record[4:])
    marker, payload = record[4:5], record[5:]
    decoders = {b"Z": zlib.decompress, b"2": bz2.decompress, b"X": lzma.decompress, b"0": bytes}
    if marker not in decoders:
        raise RDataError(f"unknown compression marker {marker!r}")
    return decoders[marker](payload)


def read_lazyload_db(stem: Path) -> dict:
    """All variables of `stem`.rdb (indexed by `stem`.rdx), e.g. `.../janeaustenr/data/Rdata`."""
    stem = Path(stem)
    index = unserialize(gzip.decompress(stem.with_suffix(".rdx").read_bytes()))
    method = index.get("compressed")
    method = int(method[0]) if isinstance(method, list) else 1
    blob = stem.with_suffix(".rdb").read_bytes()
    out = {}
    for name, (offset, length) in index["variables"].items():
        out[name] = unserialize(_decompress(blob[offset : offset + length], method))
    return out
