"""The envelope: large records compressed or split under a limit and reassembled bit-exact."""

from __future__ import annotations

import hashlib
import json
import os
import random

import pytest

from flywheel.bus.base import Record
from flywheel.bus.envelope import CHUNK, ENCODING, SET, EnvelopeError, Reassembler, encode

pytestmark = pytest.mark.unit

LIMIT = 900_000
HEADERS = {"event_type": "GenerationEvent", "event_id": "e-1"}


def _size(value: bytes, headers: dict[str, str]) -> int:
    return len(value) + sum(len(k.encode()) + len(v.encode()) for k, v in headers.items())


def _records(parts: list[tuple[bytes, dict[str, str]]], *, start: int = 0, partition: int = 0) -> list[Record]:
    return [Record("gen", partition, start + i, "s-1", v, h) for i, (v, h) in enumerate(parts)]


def _whole(reassembler: Reassembler, records: list[Record]) -> list[Record]:
    out = []
    for record in records:
        whole = reassembler.feed(record)
        if whole is not None:
            out.append(whole)
    return out


def test_a_record_under_the_limit_is_untouched() -> None:
    value = os.urandom(1000)
    assert encode(value, HEADERS, LIMIT) == [(value, HEADERS)]
    assert _whole(Reassembler(), _records([(value, HEADERS)]))[0].value == value


def test_a_compressible_megabyte_is_one_compressed_record() -> None:
    rng = random.Random()
    tokens = [rng.randrange(50_000) for _ in range(200_000)]
    value = json.dumps({"prompt_token_ids": tokens, "logprobs": [-0.5] * 50_000}).encode()
    assert len(value) > 1_000_000
    parts = encode(value, HEADERS, LIMIT)
    assert len(parts) == 1 and parts[0][1][ENCODING] == "zstd" and _size(*parts[0]) <= LIMIT
    (whole,) = _whole(Reassembler(), _records(parts))
    assert whole.value == value and whole.headers == HEADERS


@pytest.mark.parametrize("size", [1_500_000, 10_000_000])
def test_random_megabytes_split_into_chunks_and_come_back_bit_exact(size: int) -> None:
    value = os.urandom(size)  # incompressible: zstd cannot bring it under the limit
    parts = encode(value, HEADERS, LIMIT)
    assert len(parts) >= -(-size // LIMIT)
    assert all(_size(v, h) <= LIMIT for v, h in parts)
    assert [h[CHUNK] for _, h in parts] == [f"{i + 1}/{len(parts)}" for i in range(len(parts))]
    assert all(h["event_id"] == "e-1" for _, h in parts)
    assert encode(value, HEADERS, LIMIT) == parts  # a re-send repeats the same records
    reassembler = Reassembler()
    got = _whole(reassembler, _records(parts))
    assert len(got) == 1
    assert hashlib.sha256(got[0].value).digest() == hashlib.sha256(value).digest()
    assert got[0].headers == HEADERS and got[0].offset == len(parts) - 1


def test_interleaved_sets_duplicates_and_commit_caps() -> None:
    """Two senders interleave on one partition; one set is partly sent, then re-sent whole."""
    a, b = os.urandom(2_000_000), os.urandom(2_500_000)
    pa, pb = encode(a, {"event_id": "a"}, LIMIT), encode(b, {"event_id": "b"}, LIMIT)
    small = (b"small", {"event_id": "c"})
    # a's first try breaks off after one chunk; b goes through; a is re-sent whole.
    sequence = [pa[0], pb[0], small, pb[1], *pb[2:], *pa]
    records = _records(sequence, start=100)
    reassembler = Reassembler()

    first = records[:3]
    assert [r.headers.get("event_id") for r in _whole(reassembler, first)] == ["c"]
    assert reassembler.committable(first) == []  # a's and b's first chunks are held in memory

    rest = records[3:]
    got = _whole(reassembler, rest)
    assert [(r.headers["event_id"], r.value) for r in got] == [("b", b), ("a", a)]
    assert reassembler.committable(records) == records  # nothing pending: commit everything


def test_an_incomplete_set_holds_commits_then_is_dropped_past_the_horizon() -> None:
    parts = encode(os.urandom(2_000_000), {"event_id": "x"}, LIMIT)
    reassembler = Reassembler(horizon=50)
    assert reassembler.feed(_records(parts[:1], start=10)[0]) is None
    later = [Record("gen", 0, o, "k", b"v", {}) for o in (20, 59, 60, 61)]
    other = Record("gen", 1, 5, "k", b"v", {})
    assert reassembler.committable([*later[:2], other]) == [other]  # partition 0 held at offset 10
    for record in later:
        assert reassembler.feed(record) == record
    assert reassembler.abandoned == 1  # offset 61 is more than 50 past 10
    assert reassembler.committable(later) == later


def test_retain_forgets_partitions_no_longer_owned() -> None:
    parts = encode(os.urandom(2_000_000), {"event_id": "x"}, LIMIT)
    reassembler = Reassembler()
    reassembler.feed(_records(parts[:1], partition=3)[0])
    probe = [Record("gen", 3, 7, "k", b"v", {})]
    assert reassembler.committable(probe) == []
    reassembler.retain({("gen", 0)})
    assert reassembler.committable(probe) == probe


def test_broken_envelopes_raise() -> None:
    parts = encode(os.urandom(2_000_000), {"event_id": "x"}, LIMIT)
    tampered = [(v, h) for v, h in parts]
    last = tampered[-1][0]
    tampered[-1] = (last[:-1] + bytes([last[-1] ^ 0xFF]), tampered[-1][1])  # always a different byte
    with pytest.raises(EnvelopeError, match="digest"):
        _whole(Reassembler(), _records(tampered))
    with pytest.raises(EnvelopeError, match="chunk"):
        Reassembler().feed(Record("gen", 0, 0, "k", b"v", {ENCODING: "zstd", CHUNK: "3/2", SET: "d"}))
    with pytest.raises(EnvelopeError, match="decompress"):
        Reassembler().feed(Record("gen", 0, 0, "k", b"not zstd", {ENCODING: "zstd", "fw.size": "10"}))
    with pytest.raises(ValueError, match="reserved"):
        encode(b"v", {ENCODING: "x"}, LIMIT)
