"""Integer streams: byte planes, checked zstd frames, and fixed-width integer streams with escapes.

These carry a ``full`` tensor's bytes, the escaped step magnitudes of a ``sparse`` one and its
packed steps. Decoding never trusts a length it reads: a frame or stream that does not say exactly
what the caller expects raises :class:`DeltaError`.
"""

from __future__ import annotations

import struct

import numpy as np
import zstandard

from flywheel.weights.codec.bitview import UINT
from flywheel.weights.codec.state import DeltaError

_STREAM_HEAD = struct.Struct("<BQ")


def planes(arr: np.ndarray) -> bytes:
    """Little-endian bytes split into byte planes (all low bytes, then the next, ...)."""
    width = arr.dtype.itemsize
    le = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
    if width == 1:
        return le.tobytes()
    return le.view(np.uint8).reshape(-1, width).T.tobytes()


def unplanes(data: bytes | memoryview, width: int, count: int) -> np.ndarray:
    """Inverse of :func:`planes`: ``count`` unsigned integers ``width`` bytes wide."""
    raw = np.frombuffer(data, dtype=np.uint8, count=count * width)
    if width == 1:
        return raw.copy()
    columns = raw.reshape(width, count).T.copy()
    return columns.view(np.dtype(UINT[width]).newbyteorder("<")).reshape(-1).astype(UINT[width], copy=False)


def pack(values: np.ndarray, cctx: zstandard.ZstdCompressor) -> bytes:
    """Unsigned integers -> zstd(fixed width main stream with escapes + u64 escape stream).

    The width (1, 2, 4 or 8 bytes) minimises the raw size; at widths below 8 the largest value
    of the width marks an escape, whose real value is in the u64 side stream.
    """
    top = int(np.iinfo(values.dtype).max)
    best = (values.size * 8, 8)
    for width in (1, 2, 4):
        limit = (1 << (8 * width)) - 1
        escapes = int(np.count_nonzero(values >= limit)) if limit <= top else 0
        best = min(best, (values.size * width + escapes * 8, width))
        if escapes == 0:
            break
    width = best[1]
    limit = (1 << (8 * width)) - 1
    if width == 8 or limit > top:
        main = values.astype(UINT[width])
        escaped = np.empty(0, dtype=np.uint64)
    else:
        main = np.minimum(values, limit).astype(UINT[width])
        escaped = values[values >= limit].astype(np.uint64)
    raw = _STREAM_HEAD.pack(width, escaped.size) + planes(main) + planes(escaped)
    return cctx.compress(raw)


def decompress(data: bytes | memoryview, dctx: zstandard.ZstdDecompressor, limit: int, what: str) -> bytes:
    """One zstd frame that declares its content size, at most ``limit`` bytes, decoded to exactly
    that size; anything else raises :class:`DeltaError` naming ``what``."""
    try:
        size = zstandard.frame_content_size(data)
    except zstandard.ZstdError as exc:
        raise DeltaError(f"{what}: not a zstd frame: {exc}") from exc
    if size < 0 or size > limit:
        raise DeltaError(f"{what}: bad zstd frame (content size {size}, at most {limit} expected)")
    try:
        out = dctx.decompress(data)
    except zstandard.ZstdError as exc:
        raise DeltaError(f"{what}: corrupt zstd data: {exc}") from exc
    if len(out) != size:
        raise DeltaError(f"{what}: decompressed {len(out)} bytes, frame says {size}")
    return out


def unpack(data: bytes | memoryview, count: int, dctx: zstandard.ZstdDecompressor, what: str) -> np.ndarray:
    """Inverse of :func:`pack`: exactly ``count`` values as uint64."""
    raw = decompress(data, dctx, _STREAM_HEAD.size + 16 * count, what)
    if len(raw) < _STREAM_HEAD.size:
        raise DeltaError(f"{what}: stream too short")
    width, n_escaped = _STREAM_HEAD.unpack_from(raw)
    if width not in UINT or n_escaped > count:
        raise DeltaError(f"{what}: bad stream header (width {width}, {n_escaped} escapes)")
    if len(raw) != _STREAM_HEAD.size + count * width + n_escaped * 8:
        raise DeltaError(f"{what}: stream length {len(raw)} does not match its header")
    body = memoryview(raw)[_STREAM_HEAD.size :]
    main = unplanes(body, width, count).astype(np.uint64)
    escaped = unplanes(body[count * width :], 8, n_escaped)
    if width < 8:
        over = main == (1 << (8 * width)) - 1
        if int(np.count_nonzero(over)) != n_escaped:
            raise DeltaError(f"{what}: escape count does not match")
        main[over] = escaped
    elif n_escaped:
        raise DeltaError(f"{what}: escapes in a full-width stream")
    return main
