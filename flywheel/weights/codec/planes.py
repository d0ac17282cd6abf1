"""Float-aligned bit planes: a tensor's bytes as exponent codes, escapes and byte planes, both ways.

What a compressed anchor (:mod:`.anchor`) stores of one tensor. Its little-endian bytes are split
into planes of one byte per element (:func:`split_planes`), by *coding*:

- ``e8`` (bfloat16, float32: 1 sign, 8 exponent bits): the exponent byte; the sign with the top 7
  mantissa bits; then the remaining mantissa bytes, high to low. (The plain high/low byte split
  would put an exponent bit into the noisy byte.)
- ``e5`` (float16: 1 sign, 5 exponent bits, 10 mantissa bits): the exponent; the sign with the top
  2 mantissa bits (``00000smm``); the low mantissa byte.
- ``bytes`` (every other dtype): plain byte planes, low byte first.

A float's exponent plane is then stored as two *streams* (:func:`cut_streams`): 4-bit codes, two
per byte (element ``2i`` in the low nibble; an odd count pads with a 0 code), ``exponent - base``
for the :data:`WINDOW` exponents from ``base`` up (the window most of the tensor's exponents fall
in, :func:`exponent_base`) and ``WINDOW`` for any other; then those others' exponent bytes, in
order. So a float tensor is ``[codes, escapes, sign+mantissa plane, other mantissa planes...]``
and any other tensor its byte planes.

Everything works block by block (:data:`BLOCK_BYTES` of elements) on 16/32-bit word views, so the
bit twiddling stays in the CPU's cache: several times faster than whole-array passes in numpy.
Values are read as little-endian words on any host. Pure functions; no IO.
"""

from __future__ import annotations

import numpy as np
import torch

#: Exponents ``base .. base + WINDOW - 1`` get their own 4-bit code; code ``WINDOW`` escapes.
WINDOW = 15
#: Elements are cut and joined this many bytes at a time (well inside an L2 cache; even counts).
BLOCK_BYTES = 1 << 18

_FLOAT_CODING = {torch.bfloat16: "e8", torch.float32: "e8", torch.float16: "e5"}
_WORD = {2: np.dtype("<u2"), 4: np.dtype("<u4")}
_U8 = np.uint8
# np.minimum against a scalar has no SIMD loop (~2 G elements/s); against an array it runs ~13x faster.
_CAP = np.full(BLOCK_BYTES, WINDOW, dtype=_U8)
_CAP.flags.writeable = False


def coding_of(dtype: torch.dtype) -> str:
    """The plane split of ``dtype``: ``e8``, ``e5`` or ``bytes``."""
    return _FLOAT_CODING.get(dtype, "bytes")


def plane_count(coding: str, width: int) -> int:
    """How many one-byte planes an element ``width`` bytes wide is split into."""
    return 3 if coding == "e5" else width


def stream_count(coding: str, width: int) -> int:
    """How many streams a tensor is stored as (a float's exponent plane is two)."""
    return plane_count(coding, width) + (coding != "bytes")


# --- one block ----------------------------------------------------------------------------------


def _split_block(le: np.ndarray, coding: str, width: int) -> list[np.ndarray]:
    """One block's little-endian bytes as its planes."""
    if coding == "bytes":
        return list(le.reshape(-1, width).T.copy())
    x = le.view(_WORD[width])
    if coding == "e5":  # s eeeee mm mmmmmmmm
        exponent = x >> 10
        exponent &= 0x1F
        sign_top = x >> 13
        sign_top &= 0x04
        sign_top |= (x >> 8) & 0x03
        return [exponent.astype(_U8), sign_top.astype(_U8), x.astype(_U8)]
    top = x >> 16 if width == 4 else x  # s eeeeeeee mmmmmmm (then float32's 16 more bits)
    exponent = (top >> 7).astype(_U8)  # the cast drops the sign
    sign_top = top & 0x807F
    sign_top |= sign_top >> 8
    rest = [(x >> 8).astype(_U8), x.astype(_U8)] if width == 4 else []
    return [exponent, sign_top.astype(_U8), *rest]


def _join_block(planes: list[np.ndarray], coding: str, width: int, out: np.ndarray) -> None:
    """Inverse of :func:`_split_block`, written into ``out`` (``count * width`` bytes)."""
    if coding == "bytes":
        cols = out.reshape(-1, width)
        for i, plane in enumerate(planes):
            cols[:, i] = plane
        return
    word = _WORD[width]
    exponent, sign_top, *rest = planes
    x = out.view(word)
    x[:] = exponent
    s = sign_top.astype(word)
    if coding == "e5":
        x &= 0x1F  # a corrupt exponent or sign plane is caught by the tensor's digest
        x <<= 10
        low = rest[0].astype(word)
        x |= low
        low[:] = s
        low &= 0x03
        low <<= 8
        x |= low
        s &= 0x04
        s <<= 13
        x |= s
        return
    x <<= 7
    if width == 4:
        x <<= 16
        low = rest[0].astype(word)
        low <<= 8
        x |= low
        low[:] = rest[1]
        x |= low
    high = s & 0x7F
    if width == 4:
        high <<= 16
    x |= high
    s &= 0x80
    s <<= 24 if width == 4 else 8
    x |= s


# --- whole tensors -------------------------------------------------------------------------------


def _blocks(count: int, width: int) -> range:
    return range(0, count, BLOCK_BYTES // width)


def split_planes(le: np.ndarray, coding: str, width: int) -> list[np.ndarray]:
    """A tensor's little-endian bytes (``uint8``, ``count * width``) as its byte planes."""
    count = le.size // width
    planes = [np.empty(count, dtype=_U8) for _ in range(plane_count(coding, width))]
    for start in _blocks(count, width):
        stop = min(count, start + BLOCK_BYTES // width)
        for plane, part in zip(planes, _split_block(le[start * width : stop * width], coding, width), strict=True):
            plane[start:stop] = part
    return planes


def join_planes(planes: list[np.ndarray], coding: str, width: int, count: int) -> np.ndarray:
    """Inverse of :func:`split_planes`: ``count`` elements' little-endian bytes."""
    out = np.empty(count * width, dtype=_U8)
    for start in _blocks(count, width):
        stop = min(count, start + BLOCK_BYTES // width)
        _join_block([p[start:stop] for p in planes], coding, width, out[start * width : stop * width])
    return out


def exponent_base(le: np.ndarray, coding: str, width: int) -> int:
    """The start of the :data:`WINDOW` consecutive exponents most common in a sample of a float
    tensor's elements (little-endian bytes); only the size of the result depends on it."""
    rows = le.reshape(-1, width)
    sample = np.ascontiguousarray(rows[:: max(1, rows.shape[0] // 65536)]).reshape(-1)
    exponent = _split_block(sample, coding, width)[0]
    counts = np.convolve(np.bincount(exponent, minlength=256), np.ones(WINDOW, dtype=np.int64), "valid")
    return int(np.argmax(counts))


def cut_streams(le: np.ndarray, coding: str, width: int, base: int) -> list[np.ndarray]:
    """What is stored of a tensor: its byte planes, a float's exponent plane as codes and escapes
    (see the module docstring; ``base`` as :func:`exponent_base` picks it)."""
    if coding == "bytes":
        return split_planes(le, coding, width)
    count, low = le.size // width, _U8(base)
    codes_packed = np.empty((count + 1) // 2, dtype=_U8)
    others = [np.empty(count, dtype=_U8) for _ in range(plane_count(coding, width) - 1)]
    escapes = []
    for start in _blocks(count, width):
        stop = min(count, start + BLOCK_BYTES // width)
        exponent, *rest = _split_block(le[start * width : stop * width], coding, width)
        for plane, part in zip(others, rest, strict=True):
            plane[start:stop] = part
        codes = exponent - low  # below the window wraps around to above it
        np.minimum(codes, _CAP[: codes.size], out=codes)
        escaped = codes == WINDOW
        if escaped.any():
            escapes.append(exponent[escaped])
        if codes.size % 2:  # the last block of an odd count
            codes = np.append(codes, _U8(0))
        pairs = codes.view(_WORD[2])  # (a, b) as the word a | b << 8
        packed = pairs >> 4
        packed |= pairs  # low byte: a | b << 4
        codes_packed[start // 2 : start // 2 + packed.size] = packed
    return [codes_packed, np.concatenate(escapes) if escapes else np.empty(0, dtype=_U8), *others]


def escape_count(codes_packed: np.ndarray, count: int) -> int:
    """How many of the first ``count`` codes in a packed code stream are escapes."""
    low = int(np.count_nonzero((codes_packed & 0x0F) == WINDOW))
    return low + int(np.count_nonzero(codes_packed[: count // 2] >= WINDOW << 4))


def join_streams(streams: list[np.ndarray], coding: str, width: int, count: int, base: int) -> np.ndarray:
    """Inverse of :func:`cut_streams`: ``count`` elements' little-endian bytes. The escapes stream
    must hold exactly :func:`escape_count` bytes and the others their full sizes (the caller checks)."""
    if coding == "bytes":
        return join_planes(streams, coding, width, count)
    codes_packed, escapes, *others = streams
    out = np.empty(count * width, dtype=_U8)
    low, used = _U8(base), 0
    for start in _blocks(count, width):
        stop = min(count, start + BLOCK_BYTES // width)
        pairs = codes_packed[start // 2 : (stop + 1) // 2].astype(_WORD[2])
        high = pairs & 0xF0
        high <<= 4
        pairs &= 0x0F
        pairs |= high  # the word a | b << 8: bytes a, b
        codes = pairs.view(_U8)[: stop - start]
        exponent = codes + low
        escaped = np.flatnonzero(codes == WINDOW)
        if escaped.size:
            exponent[escaped] = escapes[used : used + escaped.size]
            used += escaped.size
        _join_block([exponent, *(o[start:stop] for o in others)], coding, width, out[start * width : stop * width])
    return out
