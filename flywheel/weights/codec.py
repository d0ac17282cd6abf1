"""The weight codec: canonical hashes, full checkpoints and lossless deltas between two states.

A *state* is a ``dict[str, torch.Tensor]`` (CPU or not; it is read through CPU views). Everything
here is a pure function of its inputs: no IO, no globals that change.

Delta container (format version 2), all integers little-endian::

    MAGIC (8 bytes) | u16 format version | u32 header length | header JSON (UTF-8) | payload

The header names the base and target state hashes and, per tensor of the target (in the target's
order): name, dtype, shape, scheme, and the byte lengths of its payload blobs (which follow one
another in header order). Schemes:

- ``same``: the tensor equals the base's, bit for bit; no payload.
- ``sparse``: only the changed elements, in up to three *classes* by the magnitude of the OLD
  element (``classes``: increasing magnitude thresholds at float exponent boundaries, which the
  receiver evaluates on the base it already has; small weights change far more often under Adam,
  so per-class coding beats the order-0 floor H(p)/p). Per class, the changed elements' ranks
  within the class are gap coded with a Rice code (``rice``: its parameter; ``counts``: changed
  elements) as two packed bit streams, the unary quotients and the fixed-width remainders
  (``parts``: their byte lengths, class by class), so both encode and decode vectorised. Then one
  stream of values for all classes in the same order: the *step* between the old and new element
  in an order-preserving integer view of the bits (for floats the usual sign-magnitude to
  monotone map, so a move of one ULP is a step of +-1), zigzag coded, packed at a fixed width
  chosen per stream (1, 2, 4 or 8 bytes, larger values escaped to a side stream of u64), split
  into byte planes and zstd coded. Steps wrap modulo the element width, so every bit pattern
  (NaN payloads, -0.0, infinities, denormals) round-trips exactly.
- ``full``: the new tensor's raw bytes, split into byte planes and zstd coded. Used for tensors
  absent from the base, dtype or shape changes, and whenever it is smaller than ``sparse``.

Invariants: :func:`apply_delta` either returns exactly the target state (its hash is checked against
the recorded target hash) or raises :class:`DeltaError`; it never returns wrong weights. It also
refuses a base whose hash is not the recorded base hash.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import sys
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import safetensors.torch
import torch
import zstandard

State = dict[str, torch.Tensor]

MAGIC = b"FWDELTA\x00"
FORMAT_VERSION = 2
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


def _unzigzag(z: np.ndarray) -> np.ndarray:
    one = z.dtype.type(1)
    return (z >> one) ^ (z.dtype.type(0) - (z & one))


def _map(fn: Any, items: list[Any], elements: int) -> list[Any]:
    """``map`` over tensors, on a small thread pool when the work is big enough (zstd and numpy
    release the GIL)."""
    if elements < _PARALLEL_MIN_ELEMENTS or len(items) < 2:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(_WORKERS) as pool:
        return list(pool.map(fn, items))


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
    digests = _map(lambda n: _tensor_digest(state[n]), names, sum(state[n].numel() for n in names))
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
    """Inverse of :func:`encode_full`; corrupt input raises :class:`DeltaError`."""
    try:
        return safetensors.torch.load(bytes(data))
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


# --- Rice-coded gap streams ---------------------------------------------------------------------


def _rice_k(gaps: np.ndarray) -> int:
    """The Rice parameter that minimises the exact coded size of ``gaps`` (uint64)."""
    if gaps.size == 0:
        return 0
    mean = float(gaps.mean())
    centre = int(math.log2(mean * math.log(2) + 1)) if mean > 0 else 0
    best = (math.inf, 0)
    for k in range(max(0, centre - 2), min(63, centre + 3)):
        cost = gaps.size * (k + 1) + int((gaps >> np.uint64(k)).sum(dtype=np.uint64))
        best = min(best, (cost, k))
    return best[1]


def _bit_width(k: int) -> int:
    """Bytes of the smallest unsigned type that holds ``k`` bits."""
    return next(w for w in (1, 2, 4, 8) if k <= 8 * w)


def _rice_encode(gaps: np.ndarray, k: int) -> tuple[bytes, bytes]:
    """Rice code of uint64 ``gaps`` as two bit streams: the quotients ``g >> k`` in unary (that many
    0 bits, then a 1) and the low ``k`` bits of each gap at fixed width, both packed LSB first. Kept
    apart so that both decode without a sequential scan."""
    if gaps.size == 0:
        return b"", b""
    quotient = gaps >> np.uint64(k)
    ends = np.cumsum(quotient + np.uint64(1)) - np.uint64(1)
    unary = np.zeros(int(ends[-1]) + 1, dtype=np.uint8)
    unary[ends.astype(np.int64)] = 1
    if k == 0:
        return np.packbits(unary, bitorder="little").tobytes(), b""
    width = _bit_width(k)
    low = (gaps & np.uint64((1 << k) - 1)).astype(_UINT[width]).astype(np.dtype(_UINT[width]).newbyteorder("<"))
    bits = np.unpackbits(low.view(np.uint8).reshape(-1, width), axis=1, bitorder="little")[:, :k]
    return np.packbits(unary, bitorder="little").tobytes(), np.packbits(bits, bitorder="little").tobytes()


def _rice_decode(unary: bytes | memoryview, low: bytes | memoryview, k: int, count: int, what: str) -> np.ndarray:
    """Inverse of :func:`_rice_encode`: exactly ``count`` uint64 gaps, or :class:`DeltaError`."""
    if count == 0:
        if len(unary) or len(low):
            raise DeltaError(f"{what}: bytes for an empty stream")
        return np.empty(0, dtype=np.uint64)
    if not 0 <= k < 64 or len(low) != (count * k + 7) // 8:
        raise DeltaError(f"{what}: bad Rice parameter {k} or remainder length {len(low)}")
    ends = np.flatnonzero(np.unpackbits(np.frombuffer(unary, dtype=np.uint8), bitorder="little"))
    if ends.size != count or (int(ends[-1]) >> 3) != len(unary) - 1:
        raise DeltaError(f"{what}: unary stream holds {ends.size} codes, {count} expected")
    quotient = np.diff(ends, prepend=-1).astype(np.uint64) - np.uint64(1)
    if k == 0:
        return quotient
    if int(ends[-1]) - count + 1 >= 1 << (64 - k):
        raise DeltaError(f"{what}: gap out of range")
    width = _bit_width(k)
    bits = np.unpackbits(np.frombuffer(low, dtype=np.uint8), count=count * k, bitorder="little").reshape(count, k)
    padded = np.zeros((count, 8 * width), dtype=np.uint8)
    padded[:, :k] = bits
    rem = np.packbits(padded, axis=1, bitorder="little").view(np.dtype(_UINT[width]).newbyteorder("<"))
    return (quotient << np.uint64(k)) | rem.reshape(-1).astype(np.uint64)


# --- magnitude classes --------------------------------------------------------------------------

# Mantissa bits of the float dtypes whose exponent gives the position context.
_MANTISSA = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23, torch.float64: 52}
_MAX_CLASSES = 3
_SAMPLE_STRIDE = 8
# Coded-size allowance for each extra class (its stream lengths in the header, Rice tail): bits.
_CLASS_COST_BITS = 400


def _magnitude(bits: np.ndarray) -> np.ndarray:
    return bits & bits.dtype.type((1 << (8 * bits.dtype.itemsize - 1)) - 1)


def _binary_entropy_bits(k: np.ndarray, n: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(n > 0, k / np.maximum(n, 1), 0.0)
        h = -(np.where(p > 0, p * np.log2(p), 0.0) + np.where(p < 1, (1 - p) * np.log2(1 - p), 0.0))
    return n * h


def _choose_thresholds(old_bits: np.ndarray, idx: np.ndarray, mantissa: int) -> list[int]:
    """Magnitude thresholds (as bit patterns at exponent boundaries) that split the elements into
    at most :data:`_MAX_CLASSES` classes with different change rates, chosen to minimise the sum of
    n_c * H(p_c) on a sample. Returns ``[]`` for one class. Only affects size, never correctness."""
    size = 1 << (8 * old_bits.dtype.itemsize - 1 - mantissa)
    exponents_all = (_magnitude(old_bits[::_SAMPLE_STRIDE]) >> old_bits.dtype.type(mantissa)).astype(np.int64)
    n_e = np.bincount(exponents_all, minlength=size).astype(np.float64) * (old_bits.size / max(1, exponents_all.size))
    k_e = np.bincount((_magnitude(old_bits[idx]) >> old_bits.dtype.type(mantissa)).astype(np.int64), minlength=size)
    n_e = np.maximum(n_e, k_e)
    present = np.flatnonzero(n_e > 0)
    if present.size < 2:
        return []
    cuts = np.concatenate([present, [size]])  # class boundaries may sit at any present exponent
    cn = np.concatenate([[0.0], np.cumsum(n_e)])[cuts]
    ck = np.concatenate([[0.0], np.cumsum(k_e)])[cuts].astype(np.float64)
    # cost[i, j]: coding the exponents in [cuts[i], cuts[j]) as one class (i < j).
    cost = _binary_entropy_bits(ck[None, :] - ck[:, None], cn[None, :] - cn[:, None]) + _CLASS_COST_BITS
    cost[np.tril_indices(cuts.size)] = np.inf
    last = cuts.size - 1
    best, plan = cost[0, last], []
    two = cost[0, :] + cost[:, last]
    j = int(np.argmin(two))
    if two[j] < best:
        best, plan = two[j], [j]
    if _MAX_CLASSES >= 3:
        first = cost[0, :, None] + cost  # [i, j]: classes [0, i) and [i, j)
        head = first.min(axis=0)
        three = head + cost[:, last]
        j = int(np.argmin(three))
        if three[j] < best:
            i = int(np.argmin(first[:, j]))
            best, plan = three[j], [i, j]
    return [int(cuts[c]) << mantissa for c in plan]


def _class_sets(old_bits: np.ndarray, thresholds: list[int]) -> list[np.ndarray]:
    """Positions of the elements with magnitude below each threshold (nested, increasing)."""
    mag = _magnitude(old_bits)
    return [np.flatnonzero(mag < old_bits.dtype.type(t)) for t in thresholds]


# --- per-tensor coding --------------------------------------------------------------------------


def _sparse_capable(t: torch.Tensor) -> bool:
    return t.element_size() in _TORCH_VIEW and not t.dtype.is_complex


def _encode_full_tensor(new_bits: np.ndarray, cctx: zstandard.ZstdCompressor) -> bytes:
    return cctx.compress(_planes(new_bits))


def _encode_tensor(name: str, old: torch.Tensor | None, new: torch.Tensor) -> tuple[dict[str, Any], list[bytes]]:
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    entry: dict[str, Any] = {"name": name, "dtype": _dtype_name(new.dtype), "shape": list(new.shape)}
    numel = new.numel()
    new_bits = _bits(new)
    entry["elements"] = numel
    comparable = old is not None and old.dtype == new.dtype and tuple(old.shape) == tuple(new.shape)
    if not comparable or not _sparse_capable(new):
        if comparable and np.array_equal(_bits(old), new_bits):  # type: ignore[arg-type]
            entry.update(scheme="same", changed=0)
            return entry, []
        blob = _encode_full_tensor(new_bits, cctx)
        entry.update(scheme="full", changed=numel, len=len(blob))
        return entry, [blob]
    assert old is not None
    old_bits = _bits(old)
    idx = np.flatnonzero(old_bits != new_bits)
    if idx.size == 0:
        entry.update(scheme="same", changed=0)
        return entry, []
    floating = new.dtype.is_floating_point
    mantissa = _MANTISSA.get(new.dtype)
    thresholds = _choose_thresholds(old_bits, idx, mantissa) if mantissa is not None and idx.size > 64 else []
    sets = _class_sets(old_bits, thresholds)
    klass = np.searchsorted(np.asarray(thresholds, dtype=old_bits.dtype), _magnitude(old_bits[idx]), side="right")
    blobs: list[bytes] = []
    counts: list[int] = []
    ks: list[int] = []
    order: list[np.ndarray] = []
    for c in range(len(thresholds) + 1):
        members = idx[klass == c] if thresholds else idx
        # Rank of each member within its class: elements below the class's upper threshold minus
        # those below its lower threshold, counted before it.
        rank = np.searchsorted(sets[c], members) if c < len(sets) else members.copy()
        if c > 0:
            rank -= np.searchsorted(sets[c - 1], members)
        gaps = (np.diff(rank, prepend=-1) - 1).astype(np.uint64)
        k = _rice_k(gaps)
        blobs.extend(_rice_encode(gaps, k))
        counts.append(int(members.size))
        ks.append(k)
        order.append(members)
    moved = np.concatenate(order) if len(order) > 1 else order[0]
    steps = _zigzag(_keys(new_bits[moved], floating) - _keys(old_bits[moved], floating))
    blobs.append(_pack(steps, cctx))
    sparse_len = sum(len(b) for b in blobs)
    if sparse_len > _TRY_FULL_ABOVE * new_bits.nbytes:
        full_blob = _encode_full_tensor(new_bits, cctx)
        if len(full_blob) < sparse_len:
            entry.update(scheme="full", changed=int(idx.size), len=len(full_blob))
            return entry, [full_blob]
    entry.update(scheme="sparse", changed=int(idx.size), len=sparse_len, classes=thresholds, counts=counts,
                 rice=ks, parts=[len(b) for b in blobs[:-1]])
    return entry, blobs


def encode_delta_with_summary(
    old: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    *,
    old_sha256: str | None = None,
    new_sha256: str | None = None,
) -> tuple[bytes, DeltaSummary]:
    """:func:`encode_delta`, also returning element counts and per-tensor entries.

    ``old_sha256`` / ``new_sha256``: the states' :func:`state_sha256` when the caller already has
    them (saves hashing twice); a wrong value only makes the delta unusable, never wrong.
    """
    names = list(new)
    total = sum(new[n].numel() for n in names)
    results = _map(lambda n: _encode_tensor(n, old.get(n), new[n]), names, total)
    entries = [entry for entry, _ in results]
    header = {
        "base_sha256": old_sha256 if old_sha256 is not None else state_sha256(old),
        "target_sha256": new_sha256 if new_sha256 is not None else state_sha256(new),
        "tensors": [{k: v for k, v in e.items() if k != "elements"} for e in entries],
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    parts = [MAGIC, _PREFIX.pack(FORMAT_VERSION, len(head)), head]
    for _, blobs in results:
        parts.extend(blobs)
    summary = DeltaSummary(
        elements=total, changed=sum(e["changed"] for e in entries), tensors=entries
    )
    return b"".join(parts), summary


def encode_delta(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> bytes:
    """A self-describing lossless delta that turns ``old`` (the base) into ``new`` (the target)."""
    return encode_delta_with_summary(old, new)[0]


# --- decoding -----------------------------------------------------------------------------------


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
    try:
        header = json.loads(bytes(view[start : start + head_len]).decode("utf-8"))
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
    dctx = zstandard.ZstdDecompressor()
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
    classes = len(thresholds) + 1
    top = (1 << (8 * width - 1)) - 1
    if (len(counts) != classes or len(ks) != classes or len(parts) != 2 * classes or classes > _MAX_CLASSES
            or sum(parts) > len(blob) or sum(counts) != entry["changed"] or not 0 < entry["changed"] <= numel
            or any(not 0 < t <= top for t in thresholds) or any(a >= b for a, b in zip(thresholds, thresholds[1:]))
            or (thresholds and dtype not in _MANTISSA)):
        raise DeltaError(f"tensor {name!r}: bad sparse entry")
    old_bits = _bits(old)
    sets = _class_sets(old_bits, thresholds)
    moved: list[np.ndarray] = []
    offset = 0
    for c in range(classes):
        unary = blob[offset : offset + parts[2 * c]]
        offset += parts[2 * c]
        low = blob[offset : offset + parts[2 * c + 1]]
        offset += parts[2 * c + 1]
        gaps = _rice_decode(unary, low, ks[c], counts[c], f"tensor {name!r} positions")
        if not counts[c]:
            continue
        rank = np.cumsum(gaps + np.uint64(1)) - np.uint64(1)
        upper = sets[c] if c < len(sets) else None
        size = numel if upper is None else upper.size
        if c > 0:
            lower = sets[c - 1] if upper is None else np.searchsorted(upper, sets[c - 1])
            size -= sets[c - 1].size
        if int(rank[-1]) >= size or int(gaps.max()) >= size:
            raise DeltaError(f"tensor {name!r}: change position out of range")
        rank = rank.astype(np.int64)
        if c > 0:
            # The rank-th member of ``upper`` that is not in ``lower``.
            rank = rank + np.searchsorted(lower - np.arange(lower.size), rank, side="right")
        moved.append(rank if upper is None else upper[rank])
    steps = _unpack(blob[offset:], entry["changed"], dctx, f"tensor {name!r} values")
    idx = np.concatenate(moved) if len(moved) > 1 else moved[0]
    bits = old_bits.copy()
    floating = dtype.is_floating_point
    step = _unzigzag(steps.astype(_UINT[width]))
    bits[idx] = _unkeys(_keys(bits[idx], floating) + step, floating)
    return _from_bits(bits, dtype, shape)


def decode_unverified(old: Mapping[str, torch.Tensor], delta: bytes | memoryview) -> State:
    """The state a delta describes on top of ``old``, WITHOUT checking either hash: the decoding
    work of :func:`apply_delta` alone (for benchmarks). Use :func:`apply_delta` to load weights."""
    header, offset = read_delta_header(delta)
    view = memoryview(delta)
    jobs = []
    names: list[str] = []
    total = 0
    for entry in header.tensors:
        name, _, shape, scheme = _check_entry(entry)
        length = 0 if scheme == "same" else entry["len"]
        if offset + length > len(view):
            raise DeltaError(f"truncated delta: payload of tensor {name!r} runs past the end")
        jobs.append((entry, view[offset : offset + length], old.get(name)))
        names.append(name)
        offset += length
        total += math.prod(shape)
    if offset != len(view):
        raise DeltaError(f"delta has {len(view) - offset} unexpected trailing bytes")
    if len(set(names)) != len(names):
        raise DeltaError("delta header names a tensor twice")
    try:
        tensors = _map(_decode_tensor, jobs, total)
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


def delta_stats(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Sizes of the delta from ``old`` to ``new`` next to a naive baseline and an entropy floor.

    ``bytes_full``: raw bytes of ``new``; ``bytes_delta``: this codec; ``bytes_xor_zstd``: XOR of the
    bits with the base, zstd level 3; ``bytes_entropy_floor``: order-0 estimate (H(p) per element for
    the positions plus the empirical entropy of the steps, raw bytes for tensors with no base).
    """
    delta, summary = encode_delta_with_summary(old, new)
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
