"""The framing the codec's containers share: magic, format version, header length, zstd-coded JSON header.

Anchors (:mod:`.anchor`) and deltas (:mod:`.container`) both begin, integers little-endian::

    MAGIC (8 bytes) | u16 format version | u32 header length | zstd(header JSON, UTF-8) | body

The header JSON is compact (no spaces) and coded at the caller's zstd level (both shape the
persisted bytes: the same header always frames to the same bytes).

Invariant: :func:`read_framed_header` checks the magic, the version, that the header lies within
the data, that it is one zstd frame of at most ``limit`` bytes and that it is JSON; anything else
raises :class:`.state.DeltaError` naming the container (``what``), never returns a partial header.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import zstandard

from flywheel.weights.codec.state import DeltaError
from flywheel.weights.codec.streams import decompress

#: After the magic: the format version and the header's length.
PREFIX = struct.Struct("<HI")
#: The decoded header JSON may not be larger than this.
HEADER_LIMIT = 1 << 28


def header_bytes(header: dict[str, Any], level: int) -> bytes:
    """``header`` as compact JSON, zstd coded at ``level`` (names and keys repeat)."""
    return zstandard.ZstdCompressor(level=level).compress(json.dumps(header, separators=(",", ":")).encode())


def frame_header(magic: bytes, version: int, header: dict[str, Any], level: int) -> bytes:
    """The frame's start: ``magic``, ``version``, the coded header's length and the coded header;
    the body follows it."""
    head = header_bytes(header, level)
    return b"".join([magic, PREFIX.pack(version, len(head)), head])


def read_framed_header(data: bytes | memoryview, magic: bytes, version: int, what: str,
                       limit: int = HEADER_LIMIT) -> tuple[Any, int]:
    """The decoded header JSON (any JSON value: the caller checks its shape) and the body's offset,
    after checking the frame (see the module invariant); errors name ``what`` (``"delta"``)."""
    view = memoryview(data)
    if len(view) < len(magic) + PREFIX.size or bytes(view[: len(magic)]) != magic:
        raise DeltaError(f"not a flywheel {what} (bad magic or too short)")
    found, head_len = PREFIX.unpack_from(view, len(magic))
    if found != version:
        raise DeltaError(f"unsupported {what} format version {found} (this build reads {version})")
    start = len(magic) + PREFIX.size
    if start + head_len > len(view):
        raise DeltaError(f"truncated {what}: header runs past the end")
    text = decompress(view[start : start + head_len], zstandard.ZstdDecompressor(), limit, f"{what} header")
    try:
        header = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DeltaError(f"corrupt {what} header: {exc}") from exc
    return header, start + head_len
