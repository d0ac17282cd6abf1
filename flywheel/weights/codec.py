"""The weight codec: canonical hashes, full checkpoints and lossless deltas between two states.

A *state* is a ``dict[str, torch.Tensor]`` (CPU or not; it is read through CPU views). Everything
here is a pure function of its inputs: no IO (but numba's on-disk cache of compiled kernels), no
globals that change a result (only a thread pool and per-thread zstd contexts).

Delta container (format version 3), all integers little-endian::

    MAGIC (8 bytes) | u16 format version | u32 header length | zstd(header JSON, UTF-8) | payload

The header names the base and target state hashes and, per tensor of the target (in the target's
order): name, dtype, shape, scheme, and the byte lengths of its payload blobs (which follow one
another in header order). Schemes:

- ``same``: the tensor equals the base's, bit for bit; no payload.
- ``sparse``: only the changed elements, in up to three *classes* by the magnitude of the OLD
  element (``classes``: increasing magnitude thresholds at float exponent boundaries, which the
  receiver evaluates on the base it already has; small weights change far more often under Adam,
  so per-class coding beats the order-0 floor H(p)/p). Per class, the changed elements' ranks
  within the class are gap coded with a Rice code (``rice``: its parameter; ``counts``: changed
  elements) as two packed bit streams (LSB first), the unary quotients and the fixed-width
  remainders (``parts``: their byte lengths, class by class). Then the values, for all classes in
  the same order: the *step* ``s`` between the old and new element in an order-preserving integer
  view of the bits (for floats the usual sign-magnitude to monotone map, so a move of one ULP is a
  step of +-1), zigzag coded to ``z >= 1`` and split as ``u = z - 1``: the low bit of each ``u``
  (the step's sign) as a raw bit stream, ``m = u >> 1`` (0 for a move of one ULP) in 2-bit fields,
  four per byte, zstd coded, with field value 3 escaping ``m - 3`` to a side stream (``parts``
  ends with the byte lengths of the sign and field streams; the escapes, a zstd frame of a fixed
  width integer stream, take the rest). When most moves are large (escaped), the zigzag steps
  themselves may instead be that one fixed width stream (``values``: ``"packed"``, the sign and
  field streams empty), whichever is smaller. Steps wrap modulo the element width, so every bit
  pattern (NaN payloads, -0.0, infinities, denormals) round-trips exactly.
- ``full``: the new tensor's raw bytes, split into byte planes and zstd coded. Used for tensors
  absent from the base, dtype or shape changes, and whenever it is smaller than ``sparse`` (tried
  when ``sparse`` costs over 1/16 of the raw bytes and a zstd probe of a slice says it may win).

Speed: the per-element work runs in small numba kernels (compiled once, cached on disk next to
this module or in numba's user cache) over words of 64 elements: bit masks of the changed elements
and of the class of every old element are built with vector instructions, and ranks come from
popcounts, so both directions are one pass over the tensor plus work per changed element. The
encoder picks the class thresholds on a sample of blocks of the tensor. Tensors are coded on a
small thread pool (the kernels and zstd release the GIL), largest first.

The device path: for weights on a GPU (tensors on a device other than the CPU, or ``device=``
given to :func:`encode_delta`), the per-element analysis of a sparse-capable tensor (the class
sample's histograms, the change mask, each change's class and rank, the gaps and the steps) runs as
torch ops on that device (:func:`_scan_torch`, any torch device, ``cpu`` included), and only the
changed elements' gaps and steps come back. Everything else stays on the CPU: the Rice, step and
zstd coding, the choice of scheme, tensors that cannot be sparse, hashing, and all of decoding. The
torch ops find exactly what the numba kernels find, so the delta is the same, byte for byte.

Invariants: :func:`apply_delta` either returns exactly the target state (its hash is checked against
the recorded target hash) or raises :class:`DeltaError`; it never returns wrong weights. It also
refuses a base whose hash is not the recorded base hash.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import sys
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np
import safetensors.torch
import torch
import zstandard
from llvmlite import ir as llvmir
from numba.core import cgutils
from numba.core.extending import intrinsic

State = dict[str, torch.Tensor]

MAGIC = b"FWDELTA\x00"
FORMAT_VERSION = 3
ZSTD_LEVEL = 3
_PREFIX = struct.Struct("<HI")
_STREAM_HEAD = struct.Struct("<BQ")
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_SINT = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
_TORCH_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Below this many elements in total a delta is encoded on one thread.
_PARALLEL_MIN_ELEMENTS = 1 << 18
_WORKERS = 2
# "full" is also tried when the sparse coding costs more than this fraction of the raw bytes.
_TRY_FULL_ABOVE = 1 / 16
# ... and then only if a zstd probe of this many elements suggests it may win.
_FULL_PROBE = 1 << 13
# Steps are also tried as one plain packed stream when more than 1/this of them are escaped.
_PACKED_STEPS_ABOVE = 4
# The decoded header JSON may not be larger than this.
_HEADER_LIMIT = 1 << 28


class DeltaError(ValueError):
    """A delta (or full checkpoint) is corrupt, truncated, or does not belong to the given base."""


@dataclass(frozen=True)
class DeltaHeader:
    format_version: int
    base_sha256: str
    target_sha256: str
    tensors: list[dict[str, Any]]


@dataclass(frozen=True)
class DeltaSummary:
    """What :func:`encode_delta_with_summary` learned while encoding."""

    elements: int
    changed: int
    tensors: list[dict[str, Any]]

    @property
    def fraction_changed(self) -> float:
        return self.changed / self.elements if self.elements else 0.0


# --- bit views ----------------------------------------------------------------------------------


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _parse_dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype) or name.startswith(("qint", "quint")):
        raise DeltaError(f"unknown dtype {name!r} in delta header")
    return dtype


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1)


def _bits(t: torch.Tensor) -> np.ndarray:
    """The tensor's elements as unsigned integers of the same width (a view where possible).

    Element widths other than 1, 2, 4, 8 bytes (complex128) come back as a uint8 byte view.
    """
    flat = _flat(t)
    size = flat.element_size()
    if size not in _TORCH_VIEW:
        return flat.view(torch.uint8).numpy()
    return flat.view(_TORCH_VIEW[size]).numpy().view(_UINT[size])


def _from_bits(bits: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    width = bits.dtype.itemsize
    base = torch.from_numpy(bits.view(_SINT[width]) if width > 1 else bits)
    return base.view(dtype).reshape(shape)


def _le_bytes(bits: np.ndarray) -> memoryview:
    if sys.byteorder == "big" and bits.dtype.itemsize > 1:
        bits = bits.byteswap()
    return memoryview(np.ascontiguousarray(bits)).cast("B")


def _keys(bits: np.ndarray, floating: bool) -> np.ndarray:
    """Order-preserving unsigned keys: for sign-magnitude floats, negatives below positives."""
    if not floating:
        return bits
    sign = bits.dtype.type(1 << (bits.dtype.itemsize * 8 - 1))
    return np.where(bits & sign, ~bits, bits | sign)


def _unkeys(keys: np.ndarray, floating: bool) -> np.ndarray:
    if not floating:
        return keys
    sign = keys.dtype.type(1 << (keys.dtype.itemsize * 8 - 1))
    return np.where(keys & sign, keys ^ sign, ~keys)


def _zigzag(step: np.ndarray) -> np.ndarray:
    """Wrapped unsigned step -> zigzag unsigned (small magnitudes of either sign stay small)."""
    width = step.dtype.itemsize
    signed = step.view(_SINT[width])
    return ((signed << 1) ^ (signed >> (8 * width - 1))).view(_UINT[width])


_POOL: tuple[int, ThreadPoolExecutor] | None = None
_POOL_LOCK = threading.Lock()
_LOCAL = threading.local()


def _zstd() -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
    """This thread's zstd contexts (they are not thread-safe; creating them costs more than small
    tensors take to code)."""
    pair = getattr(_LOCAL, "zstd", None)
    if pair is None:
        pair = _LOCAL.zstd = (zstandard.ZstdCompressor(level=ZSTD_LEVEL), zstandard.ZstdDecompressor())
    return pair


def _pool() -> ThreadPoolExecutor:
    """The module's thread pool, started on first use (and again in a forked child)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[0] != os.getpid():
            _POOL = (os.getpid(), ThreadPoolExecutor(_WORKERS, thread_name_prefix="flywheel-codec"))
        return _POOL[1]


def _map(fn: Any, items: list[Any], sizes: list[int]) -> list[Any]:
    """``map`` over tensors (``sizes``: their elements), on a small thread pool when the work is big
    enough (the kernels, zstd and hashlib release the GIL), largest first so the threads finish
    together."""
    if sum(sizes) < _PARALLEL_MIN_ELEMENTS or len(items) < 2:
        return [fn(item) for item in items]
    order = sorted(range(len(items)), key=lambda i: -sizes[i])
    futures = {i: _pool().submit(fn, items[i]) for i in order}
    return [futures[i].result() for i in range(len(items))]


# --- hashing and full checkpoints ---------------------------------------------------------------


def _tensor_digest(t: torch.Tensor) -> bytes:
    return hashlib.sha256(_le_bytes(_bits(t))).digest()


def state_sha256(state: Mapping[str, torch.Tensor]) -> str:
    """Canonical SHA-256 of a state, independent of dict order and memory layout.

    Two levels, so that tensors hash in parallel: each tensor's raw little-endian bytes are hashed
    on their own, then one SHA-256 covers, for every name in sorted order, the name, dtype string,
    shape, byte count and that tensor digest. Equal states give equal hashes; any bit flip, rename,
    dtype or shape change gives a different one.
    """
    names = sorted(state)
    digests = _map(lambda n: _tensor_digest(state[n]), names, [state[n].numel() for n in names])
    h = hashlib.sha256(b"flywheel-state-v1\x00")
    for name, digest in zip(names, digests, strict=True):
        t = state[name]
        encoded_name = name.encode("utf-8")
        dtype = _dtype_name(t.dtype).encode()
        shape = tuple(t.shape)
        h.update(struct.pack("<I", len(encoded_name)) + encoded_name)
        h.update(struct.pack("<I", len(dtype)) + dtype)
        h.update(struct.pack(f"<I{len(shape)}q", len(shape), *shape))
        h.update(struct.pack("<Q", t.numel() * t.element_size()))
        h.update(digest)
    return h.hexdigest()


def encode_full(state: Mapping[str, torch.Tensor]) -> bytes:
    """A safetensors file holding ``state`` (tensors that share storage are written separately)."""
    seen: set[int] = set()
    out: State = {}
    for name, t in state.items():
        t = t.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in seen:
            t = t.clone()
        seen.add(ptr)
        out[name] = t
    return safetensors.torch.save(out)


def decode_full(data: bytes) -> State:
    """Inverse of :func:`encode_full`, tensors in name order (safetensors' own order varies from
    call to call, and a delta's layout follows its input's order); corrupt input raises
    :class:`DeltaError`."""
    try:
        return dict(sorted(safetensors.torch.load(bytes(data)).items()))
    except Exception as exc:  # safetensors raises its own SafetensorError and others on bad input
        raise DeltaError(f"corrupt full checkpoint: {exc}") from exc


# --- integer streams ----------------------------------------------------------------------------


def _planes(arr: np.ndarray) -> bytes:
    """Little-endian bytes split into byte planes (all low bytes, then the next, ...)."""
    width = arr.dtype.itemsize
    le = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
    if width == 1:
        return le.tobytes()
    return le.view(np.uint8).reshape(-1, width).T.tobytes()


def _unplanes(data: bytes | memoryview, width: int, count: int) -> np.ndarray:
    raw = np.frombuffer(data, dtype=np.uint8, count=count * width)
    if width == 1:
        return raw.copy()
    planes = raw.reshape(width, count).T.copy()
    return planes.view(np.dtype(_UINT[width]).newbyteorder("<")).reshape(-1).astype(_UINT[width], copy=False)


def _pack(values: np.ndarray, cctx: zstandard.ZstdCompressor) -> bytes:
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
        main = values.astype(_UINT[width])
        escaped = np.empty(0, dtype=np.uint64)
    else:
        main = np.minimum(values, limit).astype(_UINT[width])
        escaped = values[values >= limit].astype(np.uint64)
    raw = _STREAM_HEAD.pack(width, escaped.size) + _planes(main) + _planes(escaped)
    return cctx.compress(raw)


def _decompress(data: bytes | memoryview, dctx: zstandard.ZstdDecompressor, limit: int, what: str) -> bytes:
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


def _unpack(data: bytes | memoryview, count: int, dctx: zstandard.ZstdDecompressor, what: str) -> np.ndarray:
    """Inverse of :func:`_pack`: exactly ``count`` values as uint64."""
    raw = _decompress(data, dctx, _STREAM_HEAD.size + 16 * count, what)
    if len(raw) < _STREAM_HEAD.size:
        raise DeltaError(f"{what}: stream too short")
    width, n_escaped = _STREAM_HEAD.unpack_from(raw)
    if width not in _UINT or n_escaped > count:
        raise DeltaError(f"{what}: bad stream header (width {width}, {n_escaped} escapes)")
    if len(raw) != _STREAM_HEAD.size + count * width + n_escaped * 8:
        raise DeltaError(f"{what}: stream length {len(raw)} does not match its header")
    body = memoryview(raw)[_STREAM_HEAD.size :]
    main = _unplanes(body, width, count).astype(np.uint64)
    escaped = _unplanes(body[count * width :], 8, n_escaped)
    if width < 8:
        over = main == (1 << (8 * width)) - 1
        if int(np.count_nonzero(over)) != n_escaped:
            raise DeltaError(f"{what}: escape count does not match")
        main[over] = escaped
    elif n_escaped:
        raise DeltaError(f"{what}: escapes in a full-width stream")
    return main


# --- compiled kernels ---------------------------------------------------------------------------
#
# The per-element work (finding changed elements, their classes and ranks, Rice coding, the
# decoder's scatter) runs in small numba kernels: one pass over a tensor each way, no temporaries
# the size of the tensor. They release the GIL, so tensors code in parallel on the thread pool.
# All arithmetic on element bits is done in uint64 with explicit masks to the element width.

_U64 = np.uint64


def _kernel(**options: Any) -> Any:
    """``numba.njit`` without the GIL, cached on disk where numba finds a writable place (else
    compiled once per process)."""
    def wrap(fn: Any) -> Any:
        try:
            return numba.njit(nogil=True, cache=True, **options)(fn)
        except RuntimeError:  # numba: "cannot cache function ...: no locator available"
            return numba.njit(nogil=True, **options)(fn)
    return wrap


@intrinsic
def _popcount(typingctx, x):  # pragma: no cover - compiled
    """Set bits of a uint64 (llvm.ctpop)."""
    def codegen(context, builder, signature, args):
        fnty = llvmir.FunctionType(llvmir.IntType(64), [llvmir.IntType(64)])
        return builder.call(cgutils.get_or_insert_function(builder.module, fnty, "llvm.ctpop.i64"), args)
    return numba.types.uint64(numba.types.uint64), codegen


@intrinsic
def _trailing_zeros(typingctx, x):  # pragma: no cover - compiled
    """Index of the lowest set bit of a non-zero uint64 (llvm.cttz)."""
    def codegen(context, builder, signature, args):
        fnty = llvmir.FunctionType(llvmir.IntType(64), [llvmir.IntType(64), llvmir.IntType(1)])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.cttz.i64")
        return builder.call(fn, [args[0], llvmir.Constant(llvmir.IntType(1), 0)])
    return numba.types.uint64(numba.types.uint64), codegen


@_kernel()
def _nb_key(x, sign, full, shift):  # pragma: no cover - compiled
    """Order-preserving key of sign-magnitude bits ``x`` (see :func:`_keys`), without branches."""
    neg = _U64(0) - (x >> shift)
    return x ^ (sign | (neg & full))


@_kernel()
def _nb_unkey(k, sign, full, shift):  # pragma: no cover - compiled
    neg = _U64(0) - (k >> shift)
    return k ^ ((neg & sign) | (~neg & full))


@_kernel(inline="always")
def _nb_emit(old, new, x, members, before, base, c, gaps, steps, k, last, floating, sign, full, shift):  # pragma: no cover
    """The changed elements ``x`` (bits of a word at ``base``) of one class whose members in the
    word are ``members`` and ``before`` before it: their gaps and steps appended at ``k``."""
    while x:
        p = _trailing_zeros(x)
        x &= x - _U64(1)
        r = before + np.int64(_popcount(members & ((_U64(1) << p) - _U64(1))))
        gaps[c, k] = _U64(r - last - 1)
        last = r
        i = base + np.int64(p)
        a = _U64(old[i])
        b = _U64(new[i])
        if floating:
            a = _nb_key(a, sign, full, shift)
            b = _nb_key(b, sign, full, shift)
        s = (b - a) & full
        steps[c, k] = ((s << _U64(1)) & full) ^ ((_U64(0) - (s >> shift)) & full)
        k += 1
    return k, last


@_kernel()
def _nb_scan(old, new, t1, t2, mask, top, floating, sign, full, gaps, steps, counts):  # pragma: no cover
    """One pass over a tensor: for each changed element, its class (``top`` minus the number of
    thresholds its old magnitude is below) and its rank within the class, written class by class
    as Rice gaps (``gaps[c, :counts[c]]``, the elements of the class skipped since the previous
    change) and zigzag coded steps (``steps[c, ...]``). Works on words of 64 elements: bit masks of
    the changed elements and of the elements below each threshold (vectorised), then popcounts
    give the ranks. Elements below t1 are class ``top - 2``, below t2 only ``top - 1``, the rest
    ``top``; classes below 0 have no members (their thresholds are 0). Returns False, having
    stopped early, if a class has more changes than the arrays have room for."""
    n = old.size
    cap = gaps.shape[1]
    shift = _U64(8 * old.itemsize - 1)
    k0 = k1 = k2 = 0
    last0 = last1 = last2 = -1
    c1 = 0  # elements so far below t1
    c2 = 0  # ... below t2
    full_words = n // 64
    for w in range(full_words + 1):
        base = w * 64
        size = min(64, n - base)
        d = _U64(0)
        m1 = _U64(0)
        m2 = _U64(0)
        if size == 64:
            for b in range(64):
                a = old[base + b]
                m = a & mask
                d |= _U64(a != new[base + b]) << _U64(b)
                m1 |= _U64(m < t1) << _U64(b)
                m2 |= _U64(m < t2) << _U64(b)
            rest = ~m2
        else:
            for b in range(size):
                a = old[base + b]
                m = a & mask
                d |= _U64(a != new[base + b]) << _U64(b)
                m1 |= _U64(m < t1) << _U64(b)
                m2 |= _U64(m < t2) << _U64(b)
            rest = ~m2 & ((_U64(1) << _U64(size)) - _U64(1))
        if d:
            mid = m2 & ~m1
            if (k0 + np.int64(_popcount(d & m1)) > cap or k1 + np.int64(_popcount(d & mid)) > cap
                    or k2 + np.int64(_popcount(d & rest)) > cap):
                return False
            if d & m1:
                k0, last0 = _nb_emit(old, new, d & m1, m1, c1, base, top - 2, gaps, steps, k0, last0,
                                     floating, sign, full, shift)
            if d & mid:
                k1, last1 = _nb_emit(old, new, d & mid, mid, c2 - c1, base, top - 1, gaps, steps, k1, last1,
                                     floating, sign, full, shift)
            if d & rest:
                k2, last2 = _nb_emit(old, new, d & rest, rest, base - c2, base, top, gaps, steps, k2, last2,
                                     floating, sign, full, shift)
        c1 += np.int64(_popcount(m1))
        c2 += np.int64(_popcount(m2))
    if top >= 2:
        counts[top - 2] = k0
    if top >= 1:
        counts[top - 1] = k1
    counts[top] = k2
    return True


def _select_table() -> np.ndarray:
    """``[byte * 8 + r]``: the position of the r-th set bit of ``byte``."""
    table = np.zeros(256 * 8, dtype=np.uint8)
    for byte in range(256):
        for r, bit in enumerate(b for b in range(8) if byte >> b & 1):
            table[byte * 8 + r] = bit
    return table


_SELECT8 = _select_table()
_L8 = np.uint64(0x0101010101010101)
_NO_RANK = 1 << 62  # a rank never reached
_H8 = np.uint64(0x8080808080808080)


@_kernel()
def _nb_select(x, r):  # pragma: no cover - compiled
    """Position of the ``r``-th (from 0) set bit of ``x``, which has more than ``r`` set bits
    (broadword select: byte popcounts, their prefix sums by a multiply, the byte by a SWAR compare,
    then a table)."""
    s = x - ((x >> _U64(1)) & _U64(0x5555555555555555))
    s = (s & _U64(0x3333333333333333)) + ((s >> _U64(2)) & _U64(0x3333333333333333))
    s = (s + (s >> _U64(4))) & _U64(0x0F0F0F0F0F0F0F0F)
    prefix = s * _L8  # byte i: set bits in bytes 0..i
    ru = _U64(r)
    # Bytes whose prefix is <= r: those wholly before the wanted bit.
    le = ((((ru * _L8) | _H8) - prefix) & _H8) >> _U64(7)
    byte = (le * _L8) >> _U64(56)
    shift = byte * _U64(8)
    before = ((prefix << _U64(8)) >> shift) & _U64(0xFF)
    bits = (x >> shift) & _U64(0xFF)
    return np.int64(shift) + np.int64(_SELECT8[np.int64(bits) * 8 + np.int64(ru - before)])


@_kernel(inline="always")
def _nb_hits(old, out, x, first, base, ranks, steps, ptr, end, target, floating, sign, full, shift):  # pragma: no cover
    """Move the changed members of one level in a word: ``x`` its members there, ``first`` the
    level's members before the word, ``target`` the next rank wanted (at ``ptr`` in ``ranks``)."""
    upto = first + np.int64(_popcount(x))
    while target < upto:
        i = base + _nb_select(x, target - first)
        a = _U64(old[i])
        z = steps[ptr]
        s = (z >> _U64(1)) ^ ((_U64(0) - (z & _U64(1))) & full)
        if floating:
            out[i] = _nb_unkey((_nb_key(a, sign, full, shift) + s) & full, sign, full, shift)
        else:
            out[i] = (a + s) & full
        ptr += 1
        target = ranks[ptr] if ptr < end else _NO_RANK
    return ptr, target, upto


@_kernel()
def _nb_apply(old, out, t1, t2, mask, ranks, starts, steps, floating, sign, full):  # pragma: no cover
    """Copy ``old`` into ``out`` and move the changed elements. Elements fall in three *levels*
    (below t1, below t2 only, neither); ``ranks[starts[l]:starts[l+1]]`` are the increasing ranks
    within level ``l`` of its changed elements, ``steps`` (same order) their zigzag coded moves.
    Returns True when every rank was found. Works on words of 64 elements like :func:`_nb_scan`;
    a hit's position in its word is a select on the level's bit mask."""
    n = old.size
    shift = _U64(8 * old.itemsize - 1)
    p0, p1, p2 = starts[0], starts[1], starts[2]
    e0, e1, e2 = starts[1], starts[2], starts[3]
    g0 = ranks[p0] if p0 < e0 else _NO_RANK
    g1 = ranks[p1] if p1 < e1 else _NO_RANK
    g2 = ranks[p2] if p2 < e2 else _NO_RANK
    s0 = s1 = s2 = 0  # level members before the current word
    full_words = n // 64
    for w in range(full_words + 1):
        base = w * 64
        size = min(64, n - base)
        m1 = _U64(0)
        m2 = _U64(0)
        if size == 64:
            for b in range(64):
                a = old[base + b]
                out[base + b] = a
                m = a & mask
                m1 |= _U64(m < t1) << _U64(b)
                m2 |= _U64(m < t2) << _U64(b)
            rest = ~m2
        else:
            for b in range(size):
                a = old[base + b]
                out[base + b] = a
                m = a & mask
                m1 |= _U64(m < t1) << _U64(b)
                m2 |= _U64(m < t2) << _U64(b)
            rest = ~m2 & ((_U64(1) << _U64(size)) - _U64(1))
        p0, g0, s0 = _nb_hits(old, out, m1, s0, base, ranks, steps, p0, e0, g0, floating, sign, full, shift)
        p1, g1, s1 = _nb_hits(old, out, m2 & ~m1, s1, base, ranks, steps, p1, e1, g1, floating, sign, full, shift)
        p2, g2, s2 = _nb_hits(old, out, rest, s2, base, ranks, steps, p2, e2, g2, floating, sign, full, shift)
    return p0 == e0 and p1 == e1 and p2 == e2


@_kernel()
def _nb_rice_k(gaps):  # pragma: no cover - compiled
    """The Rice parameter that minimises the exact coded size of ``gaps`` (tried around the one
    a geometric distribution of the same mean wants), and the unary stream's length in bits."""
    n = gaps.size
    total = 0.0
    for i in range(n):
        total += gaps[i]
    mean = total / n
    centre = int(np.log2(mean * np.log(2.0) + 1.0)) if mean > 0 else 0
    lo = min(max(0, centre - 2), 57)
    s0 = s1 = s2 = s3 = s4 = _U64(0)
    k0, k1, k2, k3, k4 = _U64(lo), _U64(lo + 1), _U64(lo + 2), _U64(lo + 3), _U64(lo + 4)
    for i in range(n):
        g = gaps[i]
        s0 += g >> k0
        s1 += g >> k1
        s2 += g >> k2
        s3 += g >> k3
        s4 += g >> k4
    sums = np.array([s0, s1, s2, s3, s4], dtype=np.uint64)
    best = 0
    for j in range(1, 5):
        if n * (lo + j + 1) + np.int64(sums[j]) < n * (lo + best + 1) + np.int64(sums[best]):
            best = j
    return lo + best, n + np.int64(sums[best])


@_kernel()
def _nb_rice_encode(gaps, k, unary, low):  # pragma: no cover - compiled
    """Rice code into two zeroed little-endian uint64 word buffers (see :func:`_rice_encode`)."""
    ub = 0
    lb = 0
    lowmask = (_U64(1) << _U64(k)) - _U64(1)
    for i in range(gaps.size):
        g = gaps[i]
        ub += np.int64(g >> _U64(k))
        unary[ub >> 6] |= _U64(1) << _U64(ub & 63)
        ub += 1
        if k:
            r = g & lowmask
            w = lb >> 6
            o = lb & 63
            low[w] |= r << _U64(o)
            if o + k > 64:
                low[w + 1] |= r >> _U64(64 - o)
            lb += k
    return ub, lb


@_kernel()
def _nb_rice_decode(unary, ubytes, low, k, count, limit, as_ranks, out):  # pragma: no cover - compiled
    """Inverse of :func:`_nb_rice_encode`, reading the streams as zero-padded little-endian uint64
    words (``ubytes``: the unary stream's real length in bytes): 0 when ``out`` holds exactly
    ``count`` values (gaps, or with ``as_ranks`` the running ranks, each below ``limit``), else an
    error code: 1 too few codes, 2 trailing bits, 3 value out of range."""
    nwords = unary.size
    w = 0
    cur = unary[0]
    end = -1  # position of the previous code's terminating 1 bit
    lb = 0
    prev = -1
    qmax = np.int64(1) << np.int64(62 - k)
    lowmask = (_U64(1) << _U64(k)) - _U64(1)
    for i in range(count):
        while cur == 0:
            w += 1
            if w >= nwords:
                return 1
            cur = unary[w]
        pos = w * 64 + np.int64(_trailing_zeros(cur))
        cur &= cur - _U64(1)
        q = pos - end - 1
        end = pos
        if q > qmax:
            return 3
        g = q << k
        if k:
            lw = lb >> 6
            o = lb & 63
            r = low[lw] >> _U64(o)
            if o + k > 64:
                r |= low[lw + 1] << _U64(64 - o)
            g |= np.int64(r & lowmask)
            lb += k
        if as_ranks:
            if g >= limit:
                return 3
            prev += g + 1
            if prev >= limit:
                return 3
            out[i] = prev
        else:
            out[i] = g
    # Nothing but zero padding may follow the last code, within its byte.
    if (end + 8) >> 3 != ubytes:
        return 2
    if cur:
        return 2
    for v in range(w + 1, nwords):
        if unary[v]:
            return 2
    return 0


@_kernel()
def _nb_split_steps(steps, signs, mags, escapes):  # pragma: no cover - compiled
    """Zigzag steps ``z`` (all >= 1) -> ``u = z - 1``: its low bit into the bit stream ``signs``,
    ``m = u >> 1`` into 2-bit fields of ``mags`` (four per byte), ``m - 3`` into ``escapes`` where
    ``m >= 3`` (field 3). Returns the number of escapes. Works on blocks of 32 steps, whose sign
    and field bits are gathered in two words."""
    n = steps.size
    e = 0
    for start in range(0, n, 32):
        stop = min(start + 32, n)
        sw = _U64(0)
        mw = _U64(0)
        for i in range(start, stop):
            u = _U64(steps[i]) - _U64(1)
            j = _U64(i - start)
            sw |= (u & _U64(1)) << j
            m = u >> _U64(1)
            if m >= _U64(3):
                escapes[e] = m - _U64(3)
                e += 1
                m = _U64(3)
            mw |= m << (j + j)
        for q in range((stop - start + 7) >> 3):
            signs[(start >> 3) + q] = np.uint8((sw >> _U64(8 * q)) & _U64(0xFF))
        for q in range((stop - start + 3) >> 2):
            mags[(start >> 2) + q] = np.uint8((mw >> _U64(8 * q)) & _U64(0xFF))
    return e


@_kernel()
def _nb_count_escapes(mags, n):  # pragma: no cover - compiled
    e = 0
    for i in range(n):
        e += ((mags[i >> 2] >> (2 * (i & 3))) & 3) == 3
    return e


@_kernel()
def _nb_join_steps(signs, mags, escapes, limit, out):  # pragma: no cover - compiled
    """Inverse of :func:`_nb_split_steps` into ``out`` (uint64): 0, or 1 if the escapes do not
    match, 2 if a step exceeds ``limit`` (all bits of the element width), 3 if padding bits are
    set."""
    e = 0
    n = out.size
    half = limit >> _U64(1)
    for start in range(0, n, 32):
        stop = min(start + 32, n)
        sw = _U64(0)
        mw = _U64(0)
        for q in range((stop - start + 7) >> 3):
            sw |= _U64(signs[(start >> 3) + q]) << _U64(8 * q)
        for q in range((stop - start + 3) >> 2):
            mw |= _U64(mags[(start >> 2) + q]) << _U64(8 * q)
        for i in range(start, stop):
            j = _U64(i - start)
            m = (mw >> (j + j)) & _U64(3)
            if m == _U64(3):
                if e >= escapes.size:
                    return 1
                x = _U64(escapes[e])
                e += 1
                if x > half:
                    return 2
                m = x + _U64(3)
                if m > half:
                    return 2
            u = (m << _U64(1)) + ((sw >> j) & _U64(1))
            if u >= limit:
                return 2
            out[i] = u + _U64(1)
    if e != escapes.size:
        return 1
    if n & 7 and signs[n >> 3] >> (n & 7):
        return 3
    if n & 3 and mags[n >> 2] >> (2 * (n & 3)):
        return 3
    return 0


def _encode_steps(steps: np.ndarray, cctx: zstandard.ZstdCompressor) -> tuple[list[bytes], int]:
    """The zigzag steps as three blobs: raw sign bits, zstd of the 2-bit magnitude fields, and the
    escaped magnitudes as a :func:`_pack` stream; and how many were escaped."""
    n = steps.size
    signs = np.zeros((n + 7) // 8, dtype=np.uint8)
    mags = np.zeros((n + 3) // 4, dtype=np.uint8)
    escapes = np.empty(n, dtype=np.uint64)
    count = _nb_split_steps(steps, signs, mags, escapes)
    esc = escapes[:count].astype(steps.dtype)
    return [signs.tobytes(), cctx.compress(mags.tobytes()), _pack(esc, cctx)], int(count)


def _decode_steps(signs: memoryview, mags: memoryview, rest: memoryview, count: int, width: int,
                  dctx: zstandard.ZstdDecompressor, what: str) -> np.ndarray:
    """Inverse of :func:`_encode_steps`: ``count`` zigzag steps (uint64), each a valid step of an
    element ``width`` bytes wide, or :class:`DeltaError`."""
    if len(signs) != (count + 7) // 8:
        raise DeltaError(f"{what}: sign stream of {len(signs)} bytes for {count} values")
    fields = _decompress(mags, dctx, (count + 3) // 4, what)
    if len(fields) != (count + 3) // 4:
        raise DeltaError(f"{what}: magnitude stream of {len(fields)} bytes for {count} values")
    escapes = _unpack(rest, _nb_count_escapes(_as_u8(fields), count), dctx, what)
    out = np.empty(count, dtype=np.uint64)
    err = _nb_join_steps(_as_u8(signs), _as_u8(fields), escapes, np.uint64((1 << (8 * width)) - 1), out)
    if err:
        raise DeltaError(f"{what}: " + {1: "escape count does not match", 2: "step out of range",
                                         3: "padding bits set"}[err])
    return out


# --- Rice-coded gap streams ---------------------------------------------------------------------


def _rice_k(gaps: np.ndarray) -> int:
    """The Rice parameter that minimises the exact coded size of ``gaps`` (uint64)."""
    if gaps.size == 0:
        return 0
    return int(_nb_rice_k(np.ascontiguousarray(gaps, dtype=np.uint64))[0])


def _rice_code(gaps: np.ndarray) -> tuple[int, bytes, bytes]:
    """``gaps`` (uint64) Rice coded with the best parameter: ``(k, unary, low)`` as
    :func:`_rice_encode`."""
    if gaps.size == 0:
        return 0, b"", b""
    k, unary_bits = _nb_rice_k(gaps)
    unary = np.zeros((unary_bits + 63) // 64 + 1, dtype=np.uint64)
    low = np.zeros((gaps.size * k + 63) // 64 + 1, dtype=np.uint64)
    ub, lb = _nb_rice_encode(gaps, k, unary, low)
    return int(k), _le_words(unary, ub), _le_words(low, lb)


def _rice_encode(gaps: np.ndarray, k: int) -> tuple[bytes, bytes]:
    """Rice code of uint64 ``gaps`` as two bit streams: the quotients ``g >> k`` in unary (that many
    0 bits, then a 1) and the low ``k`` bits of each gap at fixed width, both packed LSB first."""
    if gaps.size == 0:
        return b"", b""
    gaps = np.ascontiguousarray(gaps, dtype=np.uint64)
    unary_bits = int((gaps >> np.uint64(k)).sum(dtype=np.uint64)) + gaps.size
    unary = np.zeros((unary_bits + 63) // 64 + 1, dtype=np.uint64)
    low = np.zeros((gaps.size * k + 63) // 64 + 1, dtype=np.uint64)
    ub, lb = _nb_rice_encode(gaps, k, unary, low)
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


def _rice_decode(unary: bytes | memoryview, low: bytes | memoryview, k: int, count: int, what: str) -> np.ndarray:
    """Inverse of :func:`_rice_encode`: exactly ``count`` uint64 gaps, or :class:`DeltaError`."""
    _rice_check(unary, low, k, count, what)
    out = np.empty(count, dtype=np.int64)
    if count:
        err = _nb_rice_decode(_as_words(unary), len(unary), _as_words(low), k, count, 1 << 62, False, out)
        if err:
            raise DeltaError(f"{what}: {_RICE_ERRORS[err]}")
    return out.view(np.uint64)


def _rice_ranks(unary: bytes | memoryview, low: bytes | memoryview, k: int, count: int, limit: int,
                out: np.ndarray, what: str) -> None:
    """Decode a class's gaps straight into its increasing ranks (each below ``limit``) in ``out``."""
    _rice_check(unary, low, k, count, what)
    if count:
        err = _nb_rice_decode(_as_words(unary), len(unary), _as_words(low), k, count, limit, True, out)
        if err:
            raise DeltaError(f"{what}: {_RICE_ERRORS[err]}")


# --- magnitude classes --------------------------------------------------------------------------

# Mantissa bits of the float dtypes whose exponent gives the position context.
_MANTISSA = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23, torch.float64: 52}
_MAX_CLASSES = 3
# Thresholds are chosen on a sample of about _SAMPLE_BLOCKS blocks of _SAMPLE_BLOCK elements spread
# evenly over the tensor (all of a small tensor).
_SAMPLE_BLOCK = 1024
_SAMPLE_BLOCKS = 32
# Coded-size allowance for each extra class (its stream lengths in the header, Rice tail): bits.
_CLASS_COST_BITS = 400


@_kernel()
def _nb_histograms(old, new, block, every, mask, shift, n_e, k_e):  # pragma: no cover - compiled
    """Exponent histograms of a sample (blocks of ``block`` elements, every ``every``-th block) and
    of the changed elements in it. Four interleaved histograms (rows of ``n_e``, ``k_e``) keep
    repeated exponents from waiting on each other."""
    n = old.size
    for start in range(0, n, block * every):
        stop = min(start + block, n)
        i = start
        while i + 4 <= stop:
            for u in range(4):
                a = old[i + u]
                e = (a & mask) >> shift
                n_e[u, e] += 1
                if a != new[i + u]:
                    k_e[u, e] += 1
            i += 4
        while i < stop:
            a = old[i]
            e = (a & mask) >> shift
            n_e[0, e] += 1
            if a != new[i]:
                k_e[0, e] += 1
            i += 1


@_kernel()
def _nb_class_bits(n, k, class_cost):  # pragma: no cover - compiled
    """n * H(k / n) + ``class_cost``: the order-0 position cost of one class, in bits."""
    if n <= 0.0:
        return class_cost
    p = k / n
    h = 0.0
    if p > 0.0:
        h -= p * np.log2(p)
    if p < 1.0:
        h -= (1.0 - p) * np.log2(1.0 - p)
    return n * h + class_cost


@_kernel()
def _nb_split(n_e, k_e, max_classes, class_cost):  # pragma: no cover - compiled
    """Best split of the exponent range into up to three classes of consecutive present exponents,
    minimising the summed :func:`_nb_class_bits`. Returns the exponents where classes 1 and 2 start
    (-1 where there is no such class)."""
    size = n_e.size
    cuts = np.empty(size + 1, dtype=np.int64)
    m = 0
    for e in range(size):
        if n_e[e] > 0:
            cuts[m] = e
            m += 1
    if m < 2:
        return -1, -1
    cuts[m] = size
    cn = np.zeros(m + 1)
    ck = np.zeros(m + 1)
    run_n = 0.0
    run_k = 0.0
    at = 0
    for e in range(size + 1):
        if at <= m and cuts[at] == e:
            cn[at] = run_n
            ck[at] = run_k
            at += 1
        if e < size:
            run_n += n_e[e]
            run_k += k_e[e]
    last = m
    cost = np.full((m + 1, m + 1), np.inf)
    for i in range(m + 1):
        for j in range(i + 1, m + 1):
            cost[i, j] = _nb_class_bits(cn[j] - cn[i], ck[j] - ck[i], class_cost)
    best = cost[0, last]
    cut1 = -1
    cut2 = -1
    if max_classes >= 2:
        for j in range(1, last):
            c = cost[0, j] + cost[j, last]
            if c < best:
                best, cut1, cut2 = c, -1, j
    if max_classes >= 3:
        for j in range(2, last):
            tail = cost[j, last]
            for i in range(1, j):
                c = cost[0, i] + cost[i, j] + tail
                if c < best:
                    best, cut1, cut2 = c, i, j
    return (cuts[cut1] if cut1 >= 0 else -1), (cuts[cut2] if cut2 >= 0 else -1)


def _choose_thresholds(old_bits: np.ndarray, new_bits: np.ndarray, mantissa: int) -> tuple[list[int], int]:
    """Magnitude thresholds (as bit patterns at exponent boundaries) that split the elements into
    at most :data:`_MAX_CLASSES` classes with different change rates, chosen to minimise the sum of
    n_c * H(p_c) on a sample (``[]`` for one class), and the sample's estimate of the number of
    changed elements. Only affects size and speed, never correctness."""
    width = old_bits.dtype.itemsize
    size = 1 << (8 * width - 1 - mantissa)
    every = _sample_every(old_bits.size)
    n_e = np.zeros((4, size), dtype=np.int64)
    k_e = np.zeros((4, size), dtype=np.int64)
    _nb_histograms(old_bits, new_bits, _SAMPLE_BLOCK, every, _width_consts(width)[0], np.uint64(mantissa), n_e, k_e)
    return _split_classes(n_e.sum(axis=0), k_e.sum(axis=0), every, mantissa)


def _sample_every(numel: int) -> int:
    """The threshold sample takes every this-many-th block of :data:`_SAMPLE_BLOCK` elements."""
    return max(1, numel // (_SAMPLE_BLOCK * _SAMPLE_BLOCKS))


def _split_classes(n_e: np.ndarray, k_e: np.ndarray, every: int, mantissa: int) -> tuple[list[int], int]:
    """:func:`_choose_thresholds` from the sample's exponent histograms (int64, of all elements and
    of the changed ones), each sampled element standing for ``every``."""
    estimate = int(k_e.sum()) * every
    if estimate <= 64:
        return [], estimate
    cut1, cut2 = _nb_split(n_e.astype(np.float64) * every, k_e.astype(np.float64) * every,
                           _MAX_CLASSES, float(_CLASS_COST_BITS))
    return [int(c) << mantissa for c in (cut1, cut2) if c >= 0], estimate


def _kernel_thresholds(thresholds: list[int]) -> tuple[np.uint64, np.uint64, int]:
    """Up to two thresholds as the kernels' ``(t1, t2, top)``: missing ones at the front are 0
    (nothing is below), so class ``top - below t1 - below t2`` runs from 0 to ``len(thresholds)``."""
    padded = [0] * (2 - len(thresholds)) + list(thresholds)
    return np.uint64(padded[0]), np.uint64(padded[1]), len(thresholds)


def _width_consts(width: int) -> tuple[np.uint64, np.uint64, np.uint64]:
    """``(magnitude mask, sign bit, all bits)`` of an element ``width`` bytes wide."""
    bits = 8 * width
    return np.uint64((1 << (bits - 1)) - 1), np.uint64(1 << (bits - 1)), np.uint64((1 << bits) - 1)


# --- per-tensor coding --------------------------------------------------------------------------


def _sparse_capable(t: torch.Tensor) -> bool:
    return t.element_size() in _TORCH_VIEW and not t.dtype.is_complex


def _encode_full_tensor(new_bits: np.ndarray, cctx: zstandard.ZstdCompressor) -> bytes:
    return cctx.compress(_planes(new_bits))


def _full_worth_trying(new_bits: np.ndarray, sparse_len: int, cctx: zstandard.ZstdCompressor) -> bool:
    """Whether ``full`` may beat a sparse coding of ``sparse_len`` bytes (which costs over
    :data:`_TRY_FULL_ABOVE` of the raw bytes): estimated from a slice of at most :data:`_FULL_PROBE`
    elements, with a wide margin (this only saves time, the final choice compares real sizes)."""
    if new_bits.size <= 2 * _FULL_PROBE:
        return True
    probe = new_bits[(new_bits.size - _FULL_PROBE) // 2 :][:_FULL_PROBE]
    estimate = len(_encode_full_tensor(probe, cctx)) * (new_bits.size / _FULL_PROBE)
    return estimate < 1.5 * sparse_len


@dataclass(frozen=True)
class _Changes:
    """The changed elements of one tensor, the input of its sparse coding: the class thresholds
    and, class by class, the Rice gaps between their ranks (uint64) and their zigzag coded steps
    (unsigned integers of the element width), in element order."""

    thresholds: list[int]
    gaps: list[np.ndarray]
    steps: list[np.ndarray]


def _scan(old_bits: np.ndarray, new_bits: np.ndarray, dtype: torch.dtype) -> _Changes:
    """The changed elements of a tensor (as :func:`_bits` views), found by the numba kernels."""
    numel = old_bits.size
    mask, sign, full = _width_consts(old_bits.dtype.itemsize)
    mantissa = _MANTISSA.get(dtype)
    thresholds, estimate = _choose_thresholds(old_bits, new_bits, mantissa) if mantissa is not None else ([], numel)
    t1, t2, top = _kernel_thresholds(thresholds)
    classes = len(thresholds) + 1
    narrow = old_bits.dtype.type
    # Room per class for twice the sampled estimate of changes (kept small so that the allocator
    # reuses memory it has already touched), and if that was not enough, for every element.
    for cap in (min(numel, 2 * estimate + 4096), numel):
        gaps = np.empty((classes, cap), dtype=np.uint64)
        steps = np.empty((classes, cap), dtype=old_bits.dtype)
        counts = np.zeros(classes, dtype=np.int64)
        if _nb_scan(old_bits, new_bits, narrow(t1), narrow(t2), narrow(mask), top, dtype.is_floating_point,
                    sign, full, gaps, steps, counts):
            break
    return _Changes(thresholds, [gaps[c, : counts[c]] for c in range(classes)],
                    [steps[c, : counts[c]] for c in range(classes)])


def _encode_tensor(
    name: str, old: torch.Tensor | None, new: torch.Tensor, device: torch.device | None = None
) -> tuple[dict[str, Any], list[bytes]]:
    """One tensor's header entry and payload blobs; ``device``: find its changed elements with
    :func:`_scan_torch` there instead of the numba kernels (same result)."""
    cctx, _ = _zstd()
    entry: dict[str, Any] = {"name": name, "dtype": _dtype_name(new.dtype), "shape": list(new.shape)}
    numel = new.numel()
    entry["elements"] = numel
    comparable = old is not None and old.dtype == new.dtype and tuple(old.shape) == tuple(new.shape)
    if not comparable or not _sparse_capable(new) or numel == 0:
        new_bits = _bits(new)
        if comparable and np.array_equal(_bits(old), new_bits):  # type: ignore[arg-type]
            entry.update(scheme="same", changed=0)
            return entry, []
        blob = _encode_full_tensor(new_bits, cctx)
        entry.update(scheme="full", changed=numel, len=len(blob))
        return entry, [blob]
    assert old is not None
    found = _scan_torch(old, new, device) if device is not None else _scan(_bits(old), _bits(new), new.dtype)
    changed = sum(g.size for g in found.gaps)
    if changed == 0:
        entry.update(scheme="same", changed=0)
        return entry, []
    blobs: list[bytes] = []
    ks: list[int] = []
    for gaps in found.gaps:
        k, unary, low = _rice_code(gaps)
        blobs += [unary, low]
        ks.append(k)
    steps = np.concatenate(found.steps)
    step_blobs, escaped = _encode_steps(steps, cctx)
    packed = False
    if escaped * _PACKED_STEPS_ABOVE > steps.size:  # big moves: the plain packed stream may be smaller
        plain = _pack(steps, cctx)
        if len(plain) < sum(len(b) for b in step_blobs):
            step_blobs, packed = [b"", b"", plain], True
    blobs.extend(step_blobs)
    sparse_len = sum(len(b) for b in blobs)
    if sparse_len > _TRY_FULL_ABOVE * numel * new.element_size():
        new_bits = _bits(new)
        if _full_worth_trying(new_bits, sparse_len, cctx):
            full_blob = _encode_full_tensor(new_bits, cctx)
            if len(full_blob) < sparse_len:
                entry.update(scheme="full", changed=changed, len=len(full_blob))
                return entry, [full_blob]
    entry.update(scheme="sparse", changed=changed, len=sparse_len, classes=found.thresholds,
                 counts=[g.size for g in found.gaps], rice=ks, parts=[len(b) for b in blobs[:-1]])
    if packed:
        entry["values"] = "packed"
    return entry, blobs


# --- the torch path -----------------------------------------------------------------------------
#
# :func:`_scan` again, as torch tensor ops, for weights that live on a GPU (a trainer's, a node's):
# the per-element passes (the class sample's histograms, the change mask, the ranks, the steps) run
# on that device, and only the changed elements' gaps and steps, and two small histograms, come
# back to the CPU for the entropy coding. Element bits are held as *signed* integers of the element
# width (the views torch supports everywhere) and widened to int64 for the arithmetic, with wrapping
# made explicit, so that every step equals the numba kernels' to the bit.

_SIGNED_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Elements per chunk of the torch scan: bounds its temporaries (a few bytes an element, and five
# more per class threshold) whatever the tensor's size.
_TORCH_CHUNK = 1 << 24


def _signed_bits(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t``'s elements as flat signed integers of the same width on ``device``."""
    flat = t.detach().to(device).contiguous().reshape(-1)
    return flat.view(_SIGNED_VIEW[flat.element_size()])


def _wrap(x: torch.Tensor, bits: int) -> torch.Tensor:
    """int64 values reduced modulo ``2**bits`` to the signed range of that width (int64 arithmetic
    already wraps at 64 bits)."""
    if bits == 64:
        return x
    half = 1 << (bits - 1)
    return ((x + half) & ((1 << bits) - 1)) - half


def _torch_steps(a: torch.Tensor, b: torch.Tensor, floating: bool) -> torch.Tensor:
    """Zigzag coded steps from ``a`` to ``b`` (signed views of changed elements) in the
    order-preserving view, as in :func:`_nb_emit`; returned as the same signed view (the bits of the
    numba kernels' unsigned steps)."""
    bits = 8 * a.element_size()
    x, y = a.long(), b.long()
    if floating:  # sign-magnitude to monotone: negative values flip their magnitude bits
        magnitude = (1 << (bits - 1)) - 1
        x = x ^ ((x >> 63) & magnitude)
        y = y ^ ((y >> 63) & magnitude)
    s = _wrap(y - x, bits)
    return _wrap((s << 1) ^ (s >> 63), bits).to(a.dtype)


def _torch_thresholds(a: torch.Tensor, b: torch.Tensor, mantissa: int) -> list[int]:
    """:func:`_choose_thresholds` on the device: the same sample of blocks, exponent histograms
    by ``bincount``; the split itself runs on the CPU."""
    numel = a.numel()
    every = _sample_every(numel)
    stride = _SAMPLE_BLOCK * every
    if every > 1:  # every ``every``-th block: the first block of each stride, and of the tail
        rows = numel // stride

        def sample(x: torch.Tensor) -> torch.Tensor:
            head = x[: rows * stride].view(rows, stride)[:, :_SAMPLE_BLOCK].reshape(-1)
            return torch.cat([head, x[rows * stride : rows * stride + _SAMPLE_BLOCK]])

        a, b = sample(a), sample(b)
    bits = 8 * a.element_size()
    size = 1 << (bits - 1 - mantissa)
    exponent = ((a & ((1 << (bits - 1)) - 1)) >> mantissa).long()
    n_e = torch.bincount(exponent, minlength=size)
    k_e = torch.bincount(exponent[a != b], minlength=size)
    return _split_classes(n_e.cpu().numpy(), k_e.cpu().numpy(), every, mantissa)[0]


def _scan_torch(old: torch.Tensor, new: torch.Tensor, device: torch.device) -> _Changes:
    """What :func:`_scan` finds, computed with torch on ``device`` (any device torch runs on; the
    tensors are moved there if they are elsewhere). A changed element's class is the number of
    thresholds at or below its old magnitude, its rank the members of its class before it: counts
    of the elements below each threshold, by prefix sums over chunks of the tensor."""
    a, b = _signed_bits(old, device), _signed_bits(new, device)
    bits = 8 * a.element_size()
    floating = new.dtype.is_floating_point
    mantissa = _MANTISSA.get(new.dtype)
    thresholds = _torch_thresholds(a, b, mantissa) if mantissa is not None else []
    classes = len(thresholds) + 1
    below_before = [torch.zeros((), dtype=torch.int64, device=device) for _ in thresholds]
    ranks: list[list[torch.Tensor]] = [[] for _ in range(classes)]
    steps: list[list[torch.Tensor]] = [[] for _ in range(classes)]
    for start in range(0, a.numel(), _TORCH_CHUNK):
        ca, cb = a[start : start + _TORCH_CHUNK], b[start : start + _TORCH_CHUNK]
        at = torch.nonzero(ca != cb).reshape(-1)
        # bounds[j + 1]: the elements before each change that are below thresholds[j]; bounds[0]
        # and bounds[-1] those below -inf and +inf (none, all). Class c's members before a change
        # are bounds[c + 1] - bounds[c].
        bounds = [torch.zeros_like(at)]
        cls = torch.zeros_like(at)
        if thresholds:
            magnitude = ca & ((1 << (bits - 1)) - 1)
        for j, threshold in enumerate(thresholds):
            below = magnitude < threshold
            counts = torch.cumsum(below, 0, dtype=torch.int32)
            bounds.append((counts[at] - below[at].int()).long() + below_before[j])
            cls += ~below[at]
            below_before[j] = below_before[j] + counts[-1]
        bounds.append(at + start)
        step = _torch_steps(ca[at], cb[at], floating)
        for c in range(classes):
            member = cls == c
            ranks[c].append((bounds[c + 1] - bounds[c])[member])
            steps[c].append(step[member])
    gaps: list[np.ndarray] = []
    out_steps: list[np.ndarray] = []
    for c in range(classes):
        rank = torch.cat(ranks[c])
        gap = torch.diff(rank, prepend=rank.new_full((1,), -1)) - 1
        gaps.append(gap.cpu().numpy().view(np.uint64))
        out_steps.append(torch.cat(steps[c]).cpu().numpy().view(_UINT[a.element_size()]))
    return _Changes(thresholds, gaps, out_steps)


def resolve_device(name: str) -> torch.device | None:
    """The ``device`` argument of :func:`encode_delta` for a command line's ``--device``: ``cpu``
    the numba kernels (None), ``cuda`` or ``cuda:N`` that GPU, ``auto`` a GPU when there is one.
    An unknown name or a GPU that is not there raises :class:`ValueError` with a message for a person.
    """
    if name == "cpu":
        return None
    if name == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else None
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type != "cuda":
        raise ValueError(f"unknown device {name!r} (expected cpu, cuda, cuda:N or auto)")
    if not torch.cuda.is_available():
        built = "with" if torch.backends.cuda.is_built() else "without"
        raise ValueError(f"device {name!r} asked for, but CUDA is not available here "
                         f"(torch {torch.__version__}, built {built} CUDA)")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device {name!r} asked for, but there are only {torch.cuda.device_count()} CUDA devices")
    return device


def encode_delta_with_summary(
    old: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    *,
    old_sha256: str | None = None,
    new_sha256: str | None = None,
    device: str | torch.device | None = None,
) -> tuple[bytes, DeltaSummary]:
    """:func:`encode_delta`, also returning element counts and per-tensor entries.

    ``old_sha256`` / ``new_sha256``: the states' :func:`state_sha256` when the caller already has
    them (saves hashing twice); a wrong value only makes the delta unusable, never wrong.
    ``device``: as :func:`encode_delta`.
    """
    names = list(new)
    total = sum(new[n].numel() for n in names)
    chosen = None if device is None else torch.device(device)

    def encode(name: str) -> tuple[dict[str, Any], list[bytes]]:
        t = new[name]
        where = chosen if chosen is not None or t.device.type == "cpu" else t.device
        return _encode_tensor(name, old.get(name), t, where)

    results = _map(encode, names, [new[n].numel() for n in names])
    entries = [entry for entry, _ in results]
    header = {
        "base_sha256": old_sha256 if old_sha256 is not None else state_sha256(old),
        "target_sha256": new_sha256 if new_sha256 is not None else state_sha256(new),
        "tensors": [{k: v for k, v in e.items() if k != "elements"} for e in entries],
    }
    head = _header_bytes(header)
    parts = [MAGIC, _PREFIX.pack(FORMAT_VERSION, len(head)), head]
    for _, blobs in results:
        parts.extend(blobs)
    summary = DeltaSummary(
        elements=total, changed=sum(e["changed"] for e in entries), tensors=entries
    )
    return b"".join(parts), summary


def encode_delta(
    old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], *, device: str | torch.device | None = None
) -> bytes:
    """A self-describing lossless delta that turns ``old`` (the base) into ``new`` (the target).

    ``device``: the torch device that finds the changed elements (tensors elsewhere are copied
    there, one at a time); by default the numba kernels do for tensors on the CPU and torch on the
    device of any other. Every choice gives the same bytes.
    """
    return encode_delta_with_summary(old, new, device=device)[0]


# --- decoding -----------------------------------------------------------------------------------


def _header_bytes(header: dict[str, Any]) -> bytes:
    """The container's header: compact JSON, zstd coded (tensor names and keys repeat)."""
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(json.dumps(header, separators=(",", ":")).encode())


def read_delta_header(delta: bytes | memoryview) -> tuple[DeltaHeader, int]:
    """Parse and check the container prefix and header; returns it and the payload offset."""
    view = memoryview(delta)
    if len(view) < len(MAGIC) + _PREFIX.size or bytes(view[: len(MAGIC)]) != MAGIC:
        raise DeltaError("not a flywheel delta (bad magic or too short)")
    version, head_len = _PREFIX.unpack_from(view, len(MAGIC))
    if version != FORMAT_VERSION:
        raise DeltaError(f"unsupported delta format version {version} (this build reads {FORMAT_VERSION})")
    start = len(MAGIC) + _PREFIX.size
    if start + head_len > len(view):
        raise DeltaError("truncated delta: header runs past the end")
    text = _decompress(view[start : start + head_len], zstandard.ZstdDecompressor(), _HEADER_LIMIT, "delta header")
    try:
        header = json.loads(text.decode("utf-8"))
        parsed = DeltaHeader(
            format_version=version,
            base_sha256=str(header["base_sha256"]),
            target_sha256=str(header["target_sha256"]),
            tensors=list(header["tensors"]),
        )
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise DeltaError(f"corrupt delta header: {exc}") from exc
    return parsed, start + head_len


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_entry(entry: Any) -> tuple[str, torch.dtype, tuple[int, ...], str]:
    try:
        name, scheme, shape = entry["name"], entry["scheme"], tuple(entry["shape"])
    except (KeyError, TypeError) as exc:
        raise DeltaError(f"corrupt tensor entry in delta header: {exc}") from exc
    if not isinstance(name, str) or scheme not in ("same", "sparse", "full"):
        raise DeltaError(f"corrupt tensor entry in delta header: {entry!r:.200}")
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise DeltaError(f"bad shape {shape!r} for tensor {name!r}")
    required = {"same": (), "full": ("len",), "sparse": ("len", "changed")}[scheme]
    for key in required:
        if not _is_count(entry.get(key)):
            raise DeltaError(f"missing or bad {key!r} for tensor {name!r}")
    if scheme == "sparse":
        for key in ("classes", "counts", "rice", "parts"):
            value = entry.get(key)
            if not isinstance(value, list) or not all(_is_count(v) for v in value):
                raise DeltaError(f"missing or bad {key!r} for tensor {name!r}")
    return name, _parse_dtype(entry.get("dtype")), shape, scheme


def _decode_tensor(
    job: tuple[dict[str, Any], memoryview, torch.Tensor | None],
) -> torch.Tensor:
    entry, blob, old = job
    name, dtype, shape, scheme = _check_entry(entry)
    numel = math.prod(shape)
    if scheme == "same":
        if old is None or old.dtype != dtype or tuple(old.shape) != shape:
            raise DeltaError(f"tensor {name!r} is marked unchanged but the base has no matching tensor")
        return old.detach().cpu().clone()
    _, dctx = _zstd()
    width = dtype.itemsize
    if scheme == "full":
        raw = _decompress(blob, dctx, numel * width, f"tensor {name!r}")
        if len(raw) != numel * width:
            raise DeltaError(f"tensor {name!r}: {len(raw)} bytes for {numel} elements of {dtype}")
        if width in _TORCH_VIEW:
            bits = _unplanes(raw, width, numel)
        else:
            bits = np.frombuffer(raw, dtype=np.uint8).copy()
        return _from_bits(bits, dtype, shape)
    # sparse
    if old is None or old.dtype != dtype or tuple(old.shape) != shape or width not in _TORCH_VIEW:
        raise DeltaError(f"tensor {name!r} is a sparse delta but the base has no matching tensor")
    thresholds, counts, ks, parts = entry["classes"], entry["counts"], entry["rice"], entry["parts"]
    changed = entry["changed"]
    classes = len(thresholds) + 1
    top = (1 << (8 * width - 1)) - 1
    if (len(counts) != classes or len(ks) != classes or len(parts) != 2 * classes + 2 or classes > _MAX_CLASSES
            or sum(parts) > len(blob) or sum(counts) != changed or not 0 < changed <= numel
            or any(not 0 < t <= top for t in thresholds) or any(a >= b for a, b in zip(thresholds, thresholds[1:]))
            or (thresholds and dtype not in _MANTISSA)):
        raise DeltaError(f"tensor {name!r}: bad sparse entry")
    ranks = np.empty(changed, dtype=np.int64)
    starts = np.zeros(4, dtype=np.int64)  # per level (see _nb_apply): class c is level c + 3 - classes
    offset = at = 0
    for c in range(classes):
        unary = blob[offset : offset + parts[2 * c]]
        offset += parts[2 * c]
        low = blob[offset : offset + parts[2 * c + 1]]
        offset += parts[2 * c + 1]
        _rice_ranks(unary, low, ks[c], counts[c], numel, ranks[at : at + counts[c]], f"tensor {name!r} positions")
        at += counts[c]
        starts[c + 4 - classes :] = at
    signs = blob[offset : offset + parts[-2]]
    offset += parts[-2]
    mags = blob[offset : offset + parts[-1]]
    offset += parts[-1]
    what = f"tensor {name!r} values"
    if entry.get("values", "split") == "packed":
        if len(signs) or len(mags):
            raise DeltaError(f"{what}: sign or field streams beside a packed stream")
        steps = _unpack(blob[offset:], changed, dctx, what)
        if changed and (int(steps.max()) > (1 << (8 * width)) - 1 or int(steps.min()) == 0):
            raise DeltaError(f"{what}: step out of range")
    elif entry.get("values", "split") == "split":
        steps = _decode_steps(signs, mags, blob[offset:], changed, width, dctx, what)
    else:
        raise DeltaError(f"{what}: unknown value coding {entry.get('values')!r}")
    old_bits = _bits(old)
    out = np.empty_like(old_bits)
    mask, sign, full = _width_consts(width)
    t1, t2, _ = _kernel_thresholds(thresholds)
    narrow = old_bits.dtype.type
    if not _nb_apply(old_bits, out, narrow(t1), narrow(t2), narrow(mask), ranks, starts, steps,
                     dtype.is_floating_point, sign, full):
        raise DeltaError(f"tensor {name!r}: change position out of range")
    return _from_bits(out, dtype, shape)


def decode_unverified(old: Mapping[str, torch.Tensor], delta: bytes | memoryview) -> State:
    """The state a delta describes on top of ``old``, WITHOUT checking either hash: the decoding
    work of :func:`apply_delta` alone (for benchmarks). Use :func:`apply_delta` to load weights."""
    header, offset = read_delta_header(delta)
    view = memoryview(delta)
    jobs = []
    names: list[str] = []
    sizes: list[int] = []
    for entry in header.tensors:
        name, _, shape, scheme = _check_entry(entry)
        length = 0 if scheme == "same" else entry["len"]
        if offset + length > len(view):
            raise DeltaError(f"truncated delta: payload of tensor {name!r} runs past the end")
        jobs.append((entry, view[offset : offset + length], old.get(name)))
        names.append(name)
        offset += length
        sizes.append(math.prod(shape))
    if offset != len(view):
        raise DeltaError(f"delta has {len(view) - offset} unexpected trailing bytes")
    if len(set(names)) != len(names):
        raise DeltaError("delta header names a tensor twice")
    try:
        tensors = _map(_decode_tensor, jobs, sizes)
    except DeltaError:
        raise
    except (RuntimeError, ValueError, TypeError, OverflowError, IndexError) as exc:
        # Bad input that got past the checks above (an exotic dtype, an impossible view): still bad input.
        raise DeltaError(f"corrupt delta: {type(exc).__name__}: {exc}") from exc
    return dict(zip(names, tensors, strict=True))


def apply_delta(
    old: Mapping[str, torch.Tensor], delta: bytes | memoryview, *, old_sha256: str | None = None
) -> State:
    """Rebuild the target state from its base and a delta; bit-exact or :class:`DeltaError`.

    ``old_sha256``, when the caller already verified it, saves hashing the base again.
    """
    header, _ = read_delta_header(delta)
    base_hash = old_sha256 if old_sha256 is not None else state_sha256(old)
    if base_hash != header.base_sha256:
        raise DeltaError(
            f"delta is for a different parent (base {header.base_sha256[:12]}, given {base_hash[:12]})"
        )
    result = decode_unverified(old, delta)
    got = state_sha256(result)
    if got != header.target_sha256:
        raise DeltaError(
            f"reconstructed state hash {got[:12]} does not match the delta's target {header.target_sha256[:12]}"
        )
    return result


# --- statistics ---------------------------------------------------------------------------------


def _entropy_bits(counts: Iterable[int]) -> float:
    arr = np.asarray(list(counts), dtype=np.float64)
    total = arr.sum()
    if total <= 0:
        return 0.0
    p = arr[arr > 0] / total
    return float(-(p * np.log2(p)).sum() * total)


def delta_stats(
    old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], *, device: str | torch.device | None = None
) -> dict[str, Any]:
    """Sizes of the delta from ``old`` to ``new`` (encoded as :func:`encode_delta` with ``device``)
    next to a naive baseline and an entropy floor.

    ``bytes_full``: raw bytes of ``new``; ``bytes_delta``: this codec; ``bytes_xor_zstd``: XOR of the
    bits with the base, zstd level 3; ``bytes_entropy_floor``: order-0 estimate (H(p) per element for
    the positions plus the empirical entropy of the steps, raw bytes for tensors with no base).
    """
    delta, summary = encode_delta_with_summary(old, new, device=device)
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    by_dtype: dict[str, dict[str, Any]] = {}
    totals = {"bytes_full": 0, "bytes_xor_zstd": 0, "bytes_entropy_floor": 0.0}
    for entry in summary.tensors:
        name = entry["name"]
        t_new, t_old = new[name], old.get(name)
        new_bits = _bits(t_new)
        nbytes = new_bits.nbytes
        comparable = t_old is not None and t_old.dtype == t_new.dtype and tuple(t_old.shape) == tuple(t_new.shape)
        if comparable:
            assert t_old is not None
            old_bits = _bits(t_old)
            xor_len = len(cctx.compress((old_bits ^ new_bits).tobytes()))
            mask = old_bits != new_bits
            n, k = new_bits.size, int(np.count_nonzero(mask))
            floor = _entropy_bits([k, n - k])
            if k and _sparse_capable(t_new):
                floating = t_new.dtype.is_floating_point
                steps = _zigzag(_keys(new_bits[mask], floating) - _keys(old_bits[mask], floating))
                floor += _entropy_bits(np.unique(steps, return_counts=True)[1])
            elif k:
                floor += 8 * nbytes
        else:
            xor_len = len(cctx.compress(new_bits.tobytes()))
            floor = 8.0 * nbytes
        row = by_dtype.setdefault(
            entry["dtype"],
            {"tensors": 0, "elements": 0, "changed": 0, "bytes_full": 0, "bytes_delta": 0,
             "bytes_xor_zstd": 0, "bytes_entropy_floor": 0.0},
        )
        row["tensors"] += 1
        row["elements"] += entry["elements"]
        row["changed"] += entry["changed"]
        row["bytes_full"] += nbytes
        row["bytes_delta"] += entry.get("len", 0)
        row["bytes_xor_zstd"] += xor_len
        row["bytes_entropy_floor"] += floor / 8
        totals["bytes_full"] += nbytes
        totals["bytes_xor_zstd"] += xor_len
        totals["bytes_entropy_floor"] += floor / 8
    for row in by_dtype.values():
        row["fraction_changed"] = row["changed"] / row["elements"] if row["elements"] else 0.0
        row["bytes_entropy_floor"] = round(row["bytes_entropy_floor"])
    return {
        "tensors": len(summary.tensors),
        "elements": summary.elements,
        "changed": summary.changed,
        "fraction_changed": summary.fraction_changed,
        "bytes_full": totals["bytes_full"],
        "bytes_delta": len(delta),
        "bytes_xor_zstd": totals["bytes_xor_zstd"],
        "bytes_entropy_floor": round(totals["bytes_entropy_floor"]),
        "schemes": {s: sum(1 for e in summary.tensors if e["scheme"] == s) for s in ("same", "sparse", "full")},
        "by_dtype": by_dtype,
    }


def count_changed(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> tuple[int, int]:
    """``(changed, elements)`` of ``new`` against ``old``: elements whose bits differ, counting every
    element of a tensor that is new or changed dtype or shape."""
    changed = elements = 0
    for name, t_new in new.items():
        t_old = old.get(name)
        elements += t_new.numel()
        if t_old is None or t_old.dtype != t_new.dtype or tuple(t_old.shape) != tuple(t_new.shape):
            changed += t_new.numel()
        else:
            diff = _bits(t_old) != _bits(t_new)
            if diff.size != t_new.numel():  # byte view of a wide dtype
                diff = diff.reshape(t_new.numel(), -1).any(axis=1)
            changed += int(np.count_nonzero(diff))
    return changed, elements
