"""Compressed full checkpoints (anchors): a state coded losslessly as float-aligned bit planes.

A registry's full versions (version 0 and every ``full_every``-th) are what a new node fetches
whole, so they dominate a chain's cost; raw safetensors spend 16 bits on a bf16 weight whose
exponent carries ~2.5 bits of information. Format version 1, all integers little-endian (the
framing is :mod:`.framing`'s, shared with deltas)::

    MAGIC (8 bytes) | u16 format version | u32 header length | zstd(header JSON, UTF-8) | blobs

The header holds the state's ``sha256`` (:func:`.state.state_sha256`) and, per tensor in name
order: ``name``, ``dtype``, ``shape``, ``coding``, ``digest`` (hex SHA-256 of its raw
little-endian bytes, :func:`.state.tensor_digest`), ``base`` (floats only) and, per stored stream,
``lens`` (its bytes) and ``zstd`` (whether it is a zstd frame or stored raw). The blobs follow in
header order. The streams are those of :mod:`.planes`: a float's exponents as 4-bit codes for the
15 most common ones (from ``base`` up) plus the escaped others, its sign and mantissa bits as byte
planes; any other dtype as byte planes. On bf16 weights (``bench/weights``' states) the exponents
carry 2.55 bits (order 0): zstd level 1 codes the packed codes and escapes in 2.59 bits an exponent
at ~1.5 G exponents/s on one core, where the plain exponent byte plane costs 2.90 bits at 0.22 G/s
(level 3: 3.25 bits at 0.12 G/s; its match search finds short matches that cost more than the
literals they replace).

Each stream is zstd coded (level :data:`PLANE_LEVEL`) only when that makes it smaller; a stream
whose sample does not compress (sign and mantissa bits) is stored raw without trying. Tensors are
coded in parallel on the codec's thread pool (zstd, hashlib and numpy's loops release the GIL).

Invariants: decoding checks the magic, version, header, every length (each stream decodes to
exactly the bytes its tensor's shape and codes imply; the blobs end exactly at the end of the
data) and every tensor's digest and the state hash, so corrupt or truncated input raises
:class:`.state.DeltaError`, never yields wrong weights. Every bit pattern (NaN payloads, -0.0,
denormals) round-trips; the bytes depend on the state only (not on dict order or memory layout).
:func:`read_full` also reads the plain safetensors that :func:`.state.encode_full` writes (full
versions stored before anchors were compressed).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
import zstandard

from flywheel.weights.codec import framing
from flywheel.weights.codec.bitview import UINT, dtype_name, element_bits, le_bytes, tensor_from_bits
from flywheel.weights.codec.planes import coding_of, cut_streams, escape_count, exponent_base, join_streams, stream_count
from flywheel.weights.codec.state import DeltaError, State, combine_digests, decode_full, state_sha256
from flywheel.weights.codec.streams import decompress
from flywheel.weights.codec.tensorfile import StateReader
from flywheel.weights.codec.workers import map_tensors

MAGIC = b"FWANCHOR"
FORMAT_VERSION = 1
#: After the magic: the format version and the header's length (:mod:`.framing`).
PREFIX = framing.PREFIX
#: zstd level of the streams (the module docstring says why not 3).
PLANE_LEVEL = 1
#: zstd level of the header (small; names repeat).
HEADER_LEVEL = 3
# A plane is only tried with zstd when a sample of this many bytes saves at least 1/64 of itself.
_PROBE_BYTES = 1 << 16
# No zstd frame holds more than this many bytes per stored byte (an RLE block: 4 bytes for 128 KiB),
# so a frame that claims more is corrupt: refused before anything is allocated.
_ZSTD_MAX_RATIO = 1 << 15
_ZSTD_MIN_FRAME = 1 << 17
_LOCAL = threading.local()
#: One tensor as :func:`.state.combine_digests` takes it: name, dtype name, shape, bytes, SHA-256.
Entry = tuple[str, str, tuple[int, ...], int, bytes]
#: :class:`AnchorReader` reads runs of consecutive small tensors' streams (each under
#: ``READ_ALONE`` bytes) in one range of up to ``READ_BATCH`` bytes; a bigger tensor on its own.
READ_ALONE = 1 << 20
READ_BATCH = 4 << 20


def is_anchor(data: bytes | memoryview) -> bool:
    """Whether ``data`` starts like a compressed anchor (else it may be plain safetensors)."""
    return bytes(memoryview(data)[: len(MAGIC)]) == MAGIC


def _contexts() -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
    pair = getattr(_LOCAL, "zstd", None)
    if pair is None:
        pair = _LOCAL.zstd = (zstandard.ZstdCompressor(level=PLANE_LEVEL), zstandard.ZstdDecompressor())
    return pair


def _code_plane(plane: np.ndarray, cctx: zstandard.ZstdCompressor) -> tuple[bytes | np.ndarray, bool]:
    """The plane zstd coded when that is smaller, else itself (raw)."""
    if plane.size > 2 * _PROBE_BYTES:  # a noisy plane (mantissa bits) is stored without a full try
        middle = plane.size // 2
        if len(cctx.compress(plane[middle : middle + _PROBE_BYTES])) > _PROBE_BYTES - _PROBE_BYTES // 64:
            return plane, False
    coded = cctx.compress(plane)
    return (coded, True) if len(coded) < plane.size else (plane, False)


# --- encode ------------------------------------------------------------------------------------


def _encode_tensor(name: str, t: torch.Tensor, digest: bytes | None) -> tuple[dict[str, Any], list[bytes | np.ndarray], bytes]:
    """One tensor's header entry, its streams and its digest (``digest``, when the caller already
    has it: :func:`.state.tensor_digest` of ``t``)."""
    le = np.frombuffer(le_bytes(element_bits(t)), dtype=np.uint8)
    coding, width, cctx = coding_of(t.dtype), t.element_size(), _contexts()[0]
    extra = {"base": exponent_base(le, coding, width)} if coding != "bytes" else {}
    blobs, flags = [], []
    for plane in cut_streams(le, coding, width, extra.get("base", 0)):
        blob, coded = _code_plane(plane, cctx)
        blobs.append(blob)
        flags.append(coded)
    if digest is None:
        digest = hashlib.sha256(le).digest()
    entry = {"name": name, "dtype": dtype_name(t.dtype), "shape": list(t.shape), "coding": coding,
             "digest": digest.hex(), **extra, "lens": [len(b) if isinstance(b, bytes) else b.size for b in blobs],
             "zstd": flags}
    return entry, blobs, digest


def encode_anchor(state: Mapping[str, torch.Tensor], digests: Mapping[str, bytes] | None = None) -> bytes:
    """``state`` as a compressed anchor (tensors in name order; any device, any layout; tensors that
    share storage are coded separately).

    ``digests``: every tensor's :func:`.state.tensor_digest` by name, when the caller already hashed
    the state (:func:`.state.tensor_digests`), so no tensor is hashed twice; they are trusted as
    given (a wrong one makes an anchor that every read refuses). Without them each tensor is hashed
    here, from the bytes being coded."""
    return encode_anchor_from(StateReader(state), digests)[0]


def encode_anchor_from(files: Any, digests: Mapping[str, bytes] | None = None) -> tuple[bytes, list[Entry]]:
    """:func:`encode_anchor` of the tensors in ``files`` (a :class:`.tensorfile.TensorReader`,
    :class:`.tensorfile.TensorFiles` or :class:`.tensorfile.StateReader`), each read, coded and
    dropped in turn, so only the coded streams are held; and the state's per-tensor entries
    (:func:`.state.combine_digests`'s, name order), which hash to the anchor's ``sha256``."""
    names = sorted(files.index)
    if digests is not None and (set(digests) != set(names) or any(len(digests[n]) != 32 for n in names)):
        raise ValueError("digests must hold one 32-byte SHA-256 for every tensor of the state")

    def one(name: str) -> tuple[dict[str, Any], list[bytes | np.ndarray], Entry]:
        with files.view(name) as t:
            entry, blobs, digest = _encode_tensor(name, t, None if digests is None else digests[name])  # fresh streams
            return entry, blobs, (name, dtype_name(t.dtype), tuple(t.shape), t.numel() * t.element_size(), digest)

    coded = map_tensors(one, names, [files.index[n].numel for n in names])
    entries = [e for _, _, e in coded]
    header = {"sha256": combine_digests(entries), "tensors": [entry for entry, _, _ in coded]}
    head = framing.frame_header(MAGIC, FORMAT_VERSION, header, HEADER_LEVEL)
    return b"".join([head, *(b for _, blobs, _ in coded for b in blobs)]), entries


# --- decode ------------------------------------------------------------------------------------


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _parse_dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype) or name.startswith(("qint", "quint")):
        raise DeltaError(f"unknown dtype {name!r} in anchor header")
    return dtype


def _check_entry(entry: Any) -> tuple[str, torch.dtype, tuple[int, ...], int, bytes]:
    """A header entry's ``(name, dtype, shape, numel, digest)`` after checking every field."""
    if not isinstance(entry, dict):
        raise DeltaError(f"corrupt tensor entry in anchor header: {entry!r:.200}")
    name, shape, lens, flags = entry.get("name"), entry.get("shape"), entry.get("lens"), entry.get("zstd")
    if not isinstance(name, str) or not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise DeltaError(f"corrupt tensor entry in anchor header: {entry!r:.200}")
    dtype = _parse_dtype(entry.get("dtype"))
    width = torch.empty((), dtype=dtype).element_size()
    if entry.get("coding") != coding_of(dtype):
        raise DeltaError(f"tensor {name!r}: coding {entry.get('coding')!r} is not that of {dtype_name(dtype)}")
    if coding_of(dtype) != "bytes" and not (_is_count(entry.get("base")) and entry["base"] < 256):
        raise DeltaError(f"tensor {name!r}: missing or bad exponent base")
    streams = stream_count(coding_of(dtype), width)
    if not (isinstance(lens, list) and isinstance(flags, list) and len(lens) == len(flags) == streams
            and all(_is_count(n) for n in lens) and all(isinstance(f, bool) for f in flags)):
        raise DeltaError(f"tensor {name!r}: bad plane lengths or flags")
    try:
        digest = bytes.fromhex(entry.get("digest", ""))
    except (TypeError, ValueError) as exc:
        raise DeltaError(f"tensor {name!r}: bad digest") from exc
    if len(digest) != 32:
        raise DeltaError(f"tensor {name!r}: bad digest")
    numel = 1
    for d in shape:
        numel *= d
    return name, dtype, tuple(shape), numel, digest


def read_anchor_header(data: bytes | memoryview) -> tuple[dict[str, Any], int]:
    """Parse and check an anchor's prefix and header; returns the header and the blobs' offset."""
    header, offset = framing.read_framed_header(data, MAGIC, FORMAT_VERSION, "anchor")
    if not isinstance(header, dict) or not isinstance(header.get("sha256"), str) \
            or not isinstance(header.get("tensors"), list):
        raise DeltaError("corrupt anchor header: no sha256 or tensors")
    return header, offset


def _decode_plane(blob: memoryview, coded: bool, size: int, what: str) -> np.ndarray:
    if not coded:
        if len(blob) != size:
            raise DeltaError(f"{what}: {len(blob)} bytes stored raw, {size} expected")
        return np.frombuffer(blob, dtype=np.uint8)
    if size > len(blob) * _ZSTD_MAX_RATIO + _ZSTD_MIN_FRAME:
        raise DeltaError(f"{what}: {len(blob)} bytes cannot hold {size}")
    out = decompress(blob, _contexts()[1], size, what)
    if len(out) != size:
        raise DeltaError(f"{what}: decodes to {len(out)} bytes, {size} expected")
    return np.frombuffer(out, dtype=np.uint8)


#: One tensor's decoding: its header entry, dtype, shape, element count and stored streams.
_Job = tuple[dict[str, Any], torch.dtype, tuple[int, ...], int, memoryview]


def _decode_tensor(job: _Job) -> torch.Tensor:
    entry, dtype, shape, numel, body = job
    name, width = entry["name"], torch.empty((), dtype=dtype).element_size()
    coding, planes, at = entry["coding"], [], 0
    for i, (length, coded) in enumerate(zip(entry["lens"], entry["zstd"], strict=True)):
        size = numel
        if coding != "bytes" and i < 2:  # the exponent codes, then the escaped exponents
            size = (numel + 1) // 2 if i == 0 else escape_count(planes[0], numel)
        planes.append(_decode_plane(body[at : at + length], coded, size, f"tensor {name!r} stream {i}"))
        at += length
    le = join_streams(planes, coding, width, numel, entry.get("base", 0))
    if hashlib.sha256(le).digest() != bytes.fromhex(entry["digest"]):
        raise DeltaError(f"tensor {name!r} does not match its digest (corrupt anchor)")
    if not numel:
        return torch.empty(shape, dtype=dtype)
    if width in UINT:
        bits = le.view(np.dtype(UINT[width]).newbyteorder("<")).astype(UINT[width], copy=False)
        return tensor_from_bits(bits, dtype, shape)
    return torch.from_numpy(le).view(dtype).reshape(shape)  # complex128: native bytes both ways


def _anchor_parts(header: dict[str, Any], offset: int, size: int) -> tuple[list[tuple[Any, ...]], str]:
    """Per tensor (entry, dtype, shape, elements, start, length of its streams), and the state hash,
    the header checked against the tensors' digests and an object of ``size`` bytes."""
    parts, seen, digests = [], set(), []
    for entry in header["tensors"]:
        name, dtype, shape, numel, digest = _check_entry(entry)
        if name in seen:
            raise DeltaError(f"tensor {name!r} twice in anchor header")
        seen.add(name)
        length = sum(entry["lens"])
        if offset + length > size:
            raise DeltaError(f"truncated anchor: tensor {name!r} runs past the end")
        parts.append((entry, dtype, shape, numel, offset, length))
        width = torch.empty((), dtype=dtype).element_size()
        digests.append((name, dtype_name(dtype), shape, numel * width, digest))
        offset += length
    if offset != size:
        raise DeltaError(f"anchor has {size - offset} trailing bytes")
    sha = combine_digests(digests)
    if sha != header["sha256"]:
        raise DeltaError("anchor header's state hash does not match its tensors")
    return parts, sha


def decode_anchor(data: bytes | memoryview) -> tuple[State, str]:
    """Inverse of :func:`encode_anchor`: the state (name order) and its :func:`.state.state_sha256`,
    checked against every tensor's digest; corrupt or truncated input raises :class:`DeltaError`."""
    reader, state = anchor_reader(data), {}
    reader.each(state.__setitem__)
    return dict(sorted(state.items())), reader.sha256


class AnchorReader:
    """An anchor of ``size`` bytes read by ranges (``read(offset, length)``: an object store's ranged
    GET, or a slice of the bytes in hand): the header at once (checked: ``layout``, ``sha256``), each
    tensor's streams only as :meth:`decode_into` comes to it, so the object is never held whole."""

    def __init__(self, read: Callable[[int, int], bytes | memoryview], size: int) -> None:
        fixed = len(MAGIC) + framing.PREFIX.size
        head = bytes(read(0, min(size, fixed)))
        head_len = framing.PREFIX.unpack_from(head, len(MAGIC))[1] if len(head) == fixed else 0
        if head_len > min(size - len(head), framing.HEADER_LIMIT):
            raise DeltaError("truncated anchor: header runs past the end")
        header, offset = read_anchor_header(head + bytes(read(len(head), head_len)))
        self._read = read
        self._parts, self.sha256 = _anchor_parts(header, offset, size)
        #: The tensors as ``(name, dtype, shape)`` in name order: what a file of them lays out.
        self.layout = sorted((part[0]["name"], part[1], part[2]) for part in self._parts)

    def decode_into(self, writer: Any) -> str:
        """Decode every tensor into ``writer`` (a :class:`.tensorfile.TensorWriter` laid out with
        them), as :meth:`each`; returns the state hash. On :class:`DeltaError` the caller discards
        the file."""
        for entry, dtype, shape, *_ in self._parts:
            if writer.layout.get(entry["name"]) != (dtype, shape):
                raise DeltaError(f"tensor {entry['name']!r} is not laid out as {dtype_name(dtype)} {list(shape)} "
                                 "in the output")
        self.each(writer.write)
        return self.sha256

    def each(self, take: Callable[[str, torch.Tensor], Any]) -> None:
        """``take(name, tensor)`` for every tensor, decoded on the codec's threads, each checked
        against its digest first (the digests against the state hash already)."""
        def batch(parts: list[tuple[Any, ...]]) -> None:
            start = parts[0][4]
            blob = memoryview(self._read(start, parts[-1][4] + parts[-1][5] - start))  # one read for the batch
            for entry, dtype, shape, numel, at, length in parts:
                take(entry["name"], _decode_tensor((entry, dtype, shape, numel, blob[at - start : at - start + length])))

        batches = _batches(self._parts)
        map_tensors(batch, batches, [sum(part[3] for part in parts) for parts in batches])


def _batches(parts: list[tuple[Any, ...]]) -> list[list[tuple[Any, ...]]]:
    """Consecutive small tensors in runs of at most :data:`READ_BATCH` stored bytes, every tensor
    of :data:`READ_ALONE` bytes or more on its own: one range read each, so a model's many small
    tensors (norms, biases) do not cost a request each on an object store, and a thread never
    holds more than one big tensor's streams."""
    out: list[list[tuple[Any, ...]]] = []
    held = READ_BATCH
    for part in parts:  # in the object's order: each run is one contiguous range
        if out and part[5] < READ_ALONE and held + part[5] <= READ_BATCH:
            out[-1].append(part)
            held += part[5]
        else:
            out.append([part])
            held = part[5] if part[5] < READ_ALONE else READ_BATCH  # a big tensor is read alone
    return out


def anchor_reader(data: bytes | memoryview) -> AnchorReader:
    """An :class:`AnchorReader` over an anchor held in memory."""
    view = memoryview(data)
    return AnchorReader(lambda at, length: view[at : at + length], len(view))


def read_full(data: bytes | memoryview) -> tuple[State, str]:
    """A full checkpoint in either format (a compressed anchor, or plain safetensors as
    :func:`.state.encode_full` writes them): the state in name order and its state hash."""
    if is_anchor(data):
        return decode_anchor(data)
    state = decode_full(bytes(data))
    return state, state_sha256(state)


def raw_bytes(state: Mapping[str, torch.Tensor]) -> int:
    """The state's raw tensor bytes: what an uncompressed full checkpoint holds (headers aside)."""
    return sum(t.numel() * t.element_size() for t in state.values())
