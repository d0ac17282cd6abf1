"""Records larger than the bus accepts: compressed, then split into chunks; never truncated.

Producer side, :func:`encode` ``(value, headers, limit)`` -> the records to send, in order:

- ``len(value)`` + header bytes ``<= limit``: the record itself, untouched (no envelope headers),
  so consumers that never see a large record need nothing from this module.
- Otherwise the value is zstd-compressed; if that fits, one record with ``fw.encoding: zstd``.
- Otherwise the compressed bytes are split into ``n`` chunks that each fit, every chunk carrying
  the record's own headers (``event_id``, ...) plus ``fw.encoding``, ``fw.chunk: i/n`` (1-based),
  ``fw.set`` (sha256 of the compressed bytes: names the set and verifies it) and ``fw.size``
  (the original size). Same input, same records: a re-send after a crash repeats them exactly.

``limit`` counts value and header bytes; the caller leaves room for the key and the bus's own
framing (Kafka: about 100 bytes per record under ``max.request.size``/``message.max.bytes``).

Consumer side, :class:`Reassembler` (one per consumer, fed every polled record in order):

- ``feed(record)`` returns the whole record (original value and headers, the offset of the record
  that completed it), or None while a chunk set is incomplete; a record that breaks the envelope
  (bad headers, a set whose digest does not match, corrupt zstd) raises :class:`EnvelopeError`
  (a ``ValueError``: dead-letter it like any undecodable record).
- Chunks merge by index, so the duplicates of an at-least-once re-send are harmless; a set that
  completes twice is returned twice (consumers dedup by ``event_id``, the bus contract).
- ``committable(records)`` keeps only the records before the first chunk of any incomplete set on
  their partition: committing past a chunk that is held in memory would lose it after a consumer
  restart, so offsets stay there until the set completes and its chunks are read again after a
  restart.
- When an incomplete set is dropped: the producer (the gateway's shipper) sends all chunks of a
  record back to back before it waits for acknowledgements, and re-sends the whole record, from
  its spool, until the bus acknowledges every chunk. So a set with a gap can only be completed by
  such a re-send, which repeats every chunk. A set is therefore dropped (counted in
  ``abandoned``, logged) once its partition has moved ``horizon`` offsets past its first chunk:
  either its sender's re-send brings all chunks again (a fresh set), or its sender is gone with
  its spool and it can never complete. ``retain`` forgets sets on partitions this consumer no
  longer owns (their new owner reads them again from the committed offset).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import zstandard

from flywheel.bus.base import Record

log = logging.getLogger(__name__)

ENCODING = "fw.encoding"
CHUNK = "fw.chunk"
SET = "fw.set"
SIZE = "fw.size"
_ENVELOPE = (ENCODING, CHUNK, SET, SIZE)
#: Header names a producer's own headers must not use.
RESERVED = frozenset(_ENVELOPE)
ZSTD_LEVEL = 3
#: Offsets a partition may move past the first chunk of an incomplete set before it is dropped.
DEFAULT_HORIZON = 10_000


class EnvelopeError(ValueError):
    """A record that claims an envelope but cannot be decoded from it."""


def _header_bytes(headers: dict[str, str]) -> int:
    return sum(len(k.encode("utf-8")) + len(v.encode("utf-8")) for k, v in headers.items())


def encode(value: bytes, headers: dict[str, str], limit: int) -> list[tuple[bytes, dict[str, str]]]:
    """The records that carry ``value`` under ``limit`` bytes each (see the module docstring)."""
    clash = [k for k in headers if k in _ENVELOPE]
    if clash:
        raise ValueError(f"headers {clash} are reserved for the envelope")
    if len(value) + _header_bytes(headers) <= limit:
        return [(value, headers)]
    packed = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(value)
    single = {**headers, ENCODING: "zstd", SIZE: str(len(value))}
    if len(packed) + _header_bytes(single) <= limit:
        return [(packed, single)]
    digest = hashlib.sha256(packed).hexdigest()
    base = {**single, SET: digest}
    # Chunk headers differ only in "i/n"; budget for the widest one, then the count is stable.
    room = limit - _header_bytes(base) - len(CHUNK) - 2 * len(str(len(packed))) - 1
    if room <= 0:
        raise ValueError(f"headers alone need more than the {limit} byte record limit")
    n = -(-len(packed) // room)
    return [
        (packed[i * room : (i + 1) * room], {**base, CHUNK: f"{i + 1}/{n}"})
        for i in range(n)
    ]


def _decompress(data: bytes, headers: dict[str, str]) -> bytes:
    if headers.get(ENCODING) != "zstd":
        raise EnvelopeError(f"unknown {ENCODING} {headers.get(ENCODING)!r}")
    try:
        size = int(headers[SIZE])
        value = zstandard.ZstdDecompressor().decompress(data, max_output_size=size)
    except (KeyError, ValueError, zstandard.ZstdError) as exc:
        raise EnvelopeError(f"cannot decompress an enveloped record: {exc}") from None
    if len(value) != size:
        raise EnvelopeError(f"decompressed {len(value)} bytes, the envelope says {size}")
    return value


def _plain(headers: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k not in _ENVELOPE}


@dataclass
class _Set:
    first_offset: int
    n: int
    chunks: dict[int, bytes] = field(default_factory=dict)


class Reassembler:
    """Whole records back from enveloped ones; see the module docstring for the rules."""

    def __init__(self, horizon: int = DEFAULT_HORIZON) -> None:
        self.horizon = horizon
        self._pending: dict[tuple[str, int], dict[str, _Set]] = {}
        self.abandoned = 0

    def feed(self, record: Record) -> Record | None:
        pair = (record.topic, record.partition)
        self._expire(pair, record.offset)
        headers = record.headers
        if ENCODING not in headers:
            return record
        if CHUNK not in headers:
            return replace(record, value=_decompress(record.value, headers), headers=_plain(headers))
        try:
            i, n = (int(x) for x in headers[CHUNK].split("/"))
            digest = headers[SET]
        except (KeyError, ValueError):
            raise EnvelopeError(f"bad chunk headers {headers.get(CHUNK)!r} / {headers.get(SET)!r}") from None
        if not 1 <= i <= n:
            raise EnvelopeError(f"chunk {i}/{n} out of range")
        sets = self._pending.setdefault(pair, {})
        pending = sets.get(digest)
        if pending is None or pending.n != n:
            pending = sets[digest] = _Set(record.offset, n)
        pending.chunks[i] = record.value
        if len(pending.chunks) < n:
            return None
        del sets[digest]
        packed = b"".join(pending.chunks[k] for k in range(1, n + 1))
        if hashlib.sha256(packed).hexdigest() != digest:
            raise EnvelopeError(f"chunk set {digest[:12]}... does not match its digest")
        return replace(record, value=_decompress(packed, headers), headers=_plain(headers))

    def _expire(self, pair: tuple[str, int], offset: int) -> None:
        sets = self._pending.get(pair)
        if not sets:
            return
        for digest, pending in list(sets.items()):
            if offset - pending.first_offset > self.horizon:
                del sets[digest]
                self.abandoned += 1
                log.warning(
                    "dropped incomplete chunk set %s... on %s[%d] from offset %d (%d of %d chunks): "
                    "its sender re-sends whole sets, or is gone",
                    digest[:12], pair[0], pair[1], pending.first_offset, len(pending.chunks), pending.n,
                )

    def committable(self, records: Sequence[Record]) -> list[Record]:
        """``records`` minus those at or after the first chunk of an incomplete set on their partition."""
        caps = {
            pair: min(s.first_offset for s in sets.values()) for pair, sets in self._pending.items() if sets
        }
        return [r for r in records if r.offset < caps.get((r.topic, r.partition), r.offset + 1)]

    def retain(self, assignment: set[tuple[str, int]]) -> None:
        """Forget incomplete sets on partitions outside ``assignment``."""
        for pair in [p for p in self._pending if p not in assignment]:
            del self._pending[pair]
