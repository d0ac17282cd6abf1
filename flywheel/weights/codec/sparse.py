"""The sparse scheme's streams: Rice-coded gaps between the ranks of changed elements, and their
steps as a sign bit stream, 2-bit magnitude fields and escapes (the layout is in :mod:`.container`).

Encoders return bytes; decoders check every length and padding bit and raise :class:`DeltaError`
on anything that is not exactly what an encoder writes. The per-element loops are numba kernels.
"""

from __future__ import annotations

import sys

import numpy as np
import zstandard

from flywheel.weights.codec.kernels import (
    nb_count_escapes,
    nb_join_steps,
    nb_rice_decode,
    nb_rice_encode,
    nb_rice_k,
    nb_split_steps,
)
from flywheel.weights.codec.state import DeltaError
from flywheel.weights.codec.streams import decompress, pack, unpack

# --- step streams -------------------------------------------------------------------------------


def encode_steps(steps: np.ndarray, cctx: zstandard.ZstdCompressor) -> tuple[list[bytes], int]:
    """The zigzag steps as three blobs: raw sign bits, zstd of the 2-bit magnitude fields, and the
    escaped magnitudes as a :func:`pack` stream; and how many were escaped."""
    n = steps.size
    signs = np.zeros((n + 7) // 8, dtype=np.uint8)
    mags = np.zeros((n + 3) // 4, dtype=np.uint8)
    escapes = np.empty(n, dtype=np.uint64)
    count = nb_split_steps(steps, signs, mags, escapes)
    esc = escapes[:count].astype(steps.dtype)
    return [signs.tobytes(), cctx.compress(mags.tobytes()), pack(esc, cctx)], int(count)


def decode_steps(signs: memoryview, mags: memoryview, rest: memoryview, count: int, width: int,
                 dctx: zstandard.ZstdDecompressor, what: str) -> np.ndarray:
    """Inverse of :func:`encode_steps`: ``count`` zigzag steps (uint64), each a valid step of an
    element ``width`` bytes wide, or :class:`DeltaError`."""
    if len(signs) != (count + 7) // 8:
        raise DeltaError(f"{what}: sign stream of {len(signs)} bytes for {count} values")
    fields = decompress(mags, dctx, (count + 3) // 4, what)
    if len(fields) != (count + 3) // 4:
        raise DeltaError(f"{what}: magnitude stream of {len(fields)} bytes for {count} values")
    escapes = unpack(rest, nb_count_escapes(_as_u8(fields), count), dctx, what)
    out = np.empty(count, dtype=np.uint64)
    err = nb_join_steps(_as_u8(signs), _as_u8(fields), escapes, np.uint64((1 << (8 * width)) - 1), out)
    if err:
        raise DeltaError(f"{what}: " + {1: "escape count does not match", 2: "step out of range",
                                         3: "padding bits set"}[err])
    return out


# --- Rice-coded gap streams ---------------------------------------------------------------------


def rice_k(gaps: np.ndarray) -> int:
    """The Rice parameter that minimises the exact coded size of ``gaps`` (uint64)."""
    if gaps.size == 0:
        return 0
    return int(nb_rice_k(np.ascontiguousarray(gaps, dtype=np.uint64))[0])


def rice_code(gaps: np.ndarray) -> tuple[int, bytes, bytes]:
    """``gaps`` (uint64) Rice coded with the best parameter: ``(k, unary, low)`` as
    :func:`rice_encode`."""
    if gaps.size == 0:
        return 0, b"", b""
    k, unary_bits = nb_rice_k(gaps)
    unary = np.zeros((unary_bits + 63) // 64 + 1, dtype=np.uint64)
    low = np.zeros((gaps.size * k + 63) // 64 + 1, dtype=np.uint64)
    ub, lb = nb_rice_encode(gaps, k, unary, low)
    return int(k), _le_words(unary, ub), _le_words(low, lb)


def rice_encode(gaps: np.ndarray, k: int) -> tuple[bytes, bytes]:
    """Rice code of uint64 ``gaps`` as two bit streams: the quotients ``g >> k`` in unary (that many
    0 bits, then a 1) and the low ``k`` bits of each gap at fixed width, both packed LSB first."""
    if gaps.size == 0:
        return b"", b""
    gaps = np.ascontiguousarray(gaps, dtype=np.uint64)
    unary_bits = int((gaps >> np.uint64(k)).sum(dtype=np.uint64)) + gaps.size
    unary = np.zeros((unary_bits + 63) // 64 + 1, dtype=np.uint64)
    low = np.zeros((gaps.size * k + 63) // 64 + 1, dtype=np.uint64)
    ub, lb = nb_rice_encode(gaps, k, unary, low)
    return _le_words(unary, ub), _le_words(low, lb)


def _le_words(words: np.ndarray, nbits: int) -> bytes:
    if sys.byteorder == "big":
        words = words.byteswap()
    return words.view(np.uint8)[: (nbits + 7) // 8].tobytes()


def _as_u8(data: bytes | memoryview) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8)


def _as_words(data: bytes | memoryview) -> np.ndarray:
    """Bytes as little-endian uint64 words, zero padded (one spare word at the end)."""
    words = np.zeros(len(data) // 8 + 2, dtype=np.dtype("<u8"))
    words.view(np.uint8)[: len(data)] = _as_u8(data)
    return words.astype(np.uint64, copy=False)


_RICE_ERRORS = {1: "fewer codes than expected", 2: "trailing bits after the last code", 3: "value out of range"}


def _rice_check(unary: bytes | memoryview, low: bytes | memoryview, k: int, count: int, what: str) -> None:
    if count == 0:
        if len(unary) or len(low):
            raise DeltaError(f"{what}: bytes for an empty stream")
    elif not 0 <= k < 62 or len(low) != (count * k + 7) // 8:
        raise DeltaError(f"{what}: bad Rice parameter {k} or remainder length {len(low)}")


def rice_decode(unary: bytes | memoryview, low: bytes | memoryview, k: int, count: int, what: str) -> np.ndarray:
    """Inverse of :func:`rice_encode`: exactly ``count`` uint64 gaps, or :class:`DeltaError`."""
    _rice_check(unary, low, k, count, what)
    out = np.empty(count, dtype=np.int64)
    if count:
        err = nb_rice_decode(_as_words(unary), len(unary), _as_words(low), k, count, 1 << 62, False, out)
        if err:
            raise DeltaError(f"{what}: {_RICE_ERRORS[err]}")
    return out.view(np.uint64)


def rice_ranks(unary: bytes | memoryview, low: bytes | memoryview, k: int, count: int, limit: int,
               out: np.ndarray, what: str) -> None:
    """Decode a class's gaps straight into its increasing ranks (each below ``limit``) in ``out``."""
    _rice_check(unary, low, k, count, what)
    if count:
        err = nb_rice_decode(_as_words(unary), len(unary), _as_words(low), k, count, limit, True, out)
        if err:
            raise DeltaError(f"{what}: {_RICE_ERRORS[err]}")
