"""A source body decoded within its byte cap: every ``Content-Encoding`` layer (gzip or deflate, at
most ``MAX_ENCODINGS`` stacked) decoded a bounded step at a time, so the cap bites before memory
does, however much a small compressed body would expand (a decompression bomb)."""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Sequence

MAX_ENCODINGS = 2  # stacked Content-Encodings decoded; more is refused (no server needs them)


DECODE_STEP = 64 * 1024  # bytes a decoder may produce per step, so the byte cap bites before memory does


class ReadFailed(Exception):
    """A read that stops with one of ``read_errors.READ_ERRORS``' codes."""

    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


class _Layer:
    """One Content-Encoding layer: zlib with bounded output, its produced bytes counted.

    Read as httpx reads them: ``deflate`` is zlib-wrapped (RFC 9110) or, as some servers send it,
    raw; bytes after the last gzip member that do not start another one (padding NULs) are ignored,
    as is anything after a deflate stream's end."""

    def __init__(self, coding: str) -> None:
        self.gzip = coding in ("gzip", "x-gzip")
        self.inflater: zlib._Decompress | None = zlib.decompressobj(16 + zlib.MAX_WBITS) if self.gzip else None
        self.produced = 0
        self.held = b""  # bytes not yet fed: a deflate header still being sniffed, or half a gzip magic
        self.ended = False

    @property
    def eof(self) -> bool:
        return self.ended or (self.inflater is not None and self.inflater.eof)

    def decode(self, data: bytes, limit: int) -> Iterator[bytes]:
        data, self.held = self.held + data, b""
        if self.inflater is None:  # deflate: zlib-wrapped or raw, told by its first two bytes
            if len(data) < 2:
                self.held = data
                return
            self.inflater = zlib.decompressobj(zlib.MAX_WBITS if _zlib_header(data) else -zlib.MAX_WBITS)
        while data and not self.ended:
            try:
                out = self.inflater.decompress(data, DECODE_STEP)
            except zlib.error:
                raise ReadFailed("read_failed") from None
            self.produced += len(out)
            if self.produced > limit:
                raise ReadFailed("too_large")
            if out:
                yield out
            data = self.inflater.unused_data if self.inflater.eof else self.inflater.unconsumed_tail
            if self.inflater.eof and data:
                data = self._next_member(data)

    def _next_member(self, rest: bytes) -> bytes:
        """After a stream's end: a gzip body may hold several members, one after another."""
        if self.gzip and rest[:2] == GZIP_MAGIC:
            self.inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
            return rest
        if self.gzip and rest == GZIP_MAGIC[:1]:
            self.held = rest
        else:
            self.ended = True
        return b""


GZIP_MAGIC = b"\x1f\x8b"


def _zlib_header(data: bytes) -> bool:
    """Whether two bytes are a zlib header (RFC 1950: deflate, window at most 32 KiB, checksum)."""
    return data[0] & 0x0F == 8 and data[0] >> 4 <= 7 and (data[0] << 8 | data[1]) % 31 == 0


class StackedDecoder:
    """Content-Encodings undone in reverse order of application, every layer's output bounded."""

    def __init__(self, codings: Sequence[str], limit: int) -> None:
        names = [c.strip().lower() for c in codings if c.strip() and c.strip().lower() != "identity"]
        if len(names) > MAX_ENCODINGS or any(n not in ("gzip", "x-gzip", "deflate") for n in names):
            raise ReadFailed("unsupported_encoding")
        self.layers = [_Layer(n) for n in reversed(names)]
        self.limit = limit
        self.raw_seen = 0

    def decode(self, raw: bytes) -> Iterator[bytes]:
        self.raw_seen += len(raw)
        if self.raw_seen > self.limit:
            raise ReadFailed("too_large")
        yield from self._through(raw, 0)

    def _through(self, data: bytes, depth: int) -> Iterator[bytes]:
        if depth == len(self.layers):
            yield data
            return
        for out in self.layers[depth].decode(data, self.limit):
            yield from self._through(out, depth + 1)

    def flush(self) -> Iterator[bytes]:
        """Nothing is left buffered with ``max_length`` steps; a truncated stream is a broken read."""
        if any(not layer.eof and self.raw_seen for layer in self.layers):
            raise ReadFailed("read_failed")
        return iter(())
