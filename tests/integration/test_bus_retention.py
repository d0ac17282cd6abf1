"""Retention on the bus: the local log rolls segments (offsets, commits, rewind and lag run on across
them; a log written before segments is read as it was), and its expiry erases the expired segments
(gone from disk, their bytes overwritten) while every unexpired record is still read; Kafka topics
are created with ``retention.ms`` and ``segment.ms``."""

from __future__ import annotations

import json
import os
import time

import pytest

from flywheel.bus.frames import encode_frame
from flywheel.bus.locallog import LocalLogBus
from flywheel.bus.segments import segment_bases

pytestmark = pytest.mark.integration

TOPIC = "t"


def read_all(consumer, want: int, timeout_s: float = 10.0) -> list:
    out: list = []
    deadline = time.monotonic() + timeout_s
    while len(out) < want and time.monotonic() < deadline:
        out += consumer.poll(timeout_s=0.2)
    return out


def send(bus: LocalLogBus, values: list[bytes]) -> None:
    producer = bus.producer()
    for value in values:
        producer.send(TOPIC, "k", value)  # one key: one partition, in order
    producer.close()


def test_segments_roll_and_offsets_commits_rewind_and_lag_run_across_them(tmp_path) -> None:
    bus = LocalLogBus(tmp_path, partitions=1, segment_bytes=300)
    values = [f"record-{i:03d}".encode() * 3 for i in range(40)]
    send(bus, values[:25])
    directory = bus.topic_dir(TOPIC)
    assert len(segment_bases(directory, 0)) >= 5  # rolled by size
    consumer = bus.consumer("g", [TOPIC])
    got = read_all(consumer, 25)
    assert [r.offset for r in got] == list(range(25)) and [r.value for r in got] == values[:25]
    consumer.commit(got[:12])
    assert bus.lag("g", [TOPIC]) == {TOPIC: 13}
    consumer.rewind()
    again = read_all(consumer, 13)
    assert [r.offset for r in again] == list(range(12, 25))
    consumer.commit(again)
    consumer.close()
    send(bus, values[25:])  # a second producer process appends after the first one's segments
    assert bus.lag("g", [TOPIC]) == {TOPIC: 15}
    later = bus.consumer("g", [TOPIC])  # a new owner resumes at the committed offset, in its segment
    rest = read_all(later, 15)
    assert [r.offset for r in rest] == list(range(25, 40)) and [r.value for r in rest] == values[25:]
    later.close()


def test_expiry_erases_old_segments_and_keeps_every_unexpired_record(tmp_path) -> None:
    bus = LocalLogBus(tmp_path, partitions=1, segment_bytes=300, retention_s=3600)
    send(bus, [b"old-secret-%03d" % i for i in range(20)])
    directory = bus.topic_dir(TOPIC)
    old = [directory / name for name in os.listdir(directory) if name.endswith(".log")]
    past = time.time() - 7200
    for path in old:
        os.utime(path, (past, past))  # written two hours ago
    send(bus, [b"new-%03d" % i for i in range(5)])
    reader = bus.consumer("slow", [TOPIC])  # owns the partition before the expiry, reads after
    assert reader.poll(timeout_s=0.5, max_records=1)[0].offset == 0
    held = {path: path.open("rb") for path in old}  # to read the blocks of the files that go
    result = bus.expire()
    assert result["segments"] >= len(old) - 1 and result["bytes"] > 0
    kept = segment_bases(directory, 0)
    assert kept and kept[0] > 0
    for path in old:
        if path.exists():  # the newest old segment stays only if it holds the new records
            assert b"new-" in path.read_bytes()
    gone = [path for path in old if not path.exists()]
    assert len(gone) == result["segments"]
    for path, handle in held.items():  # what a descriptor opened before reads of an erased file: zeros
        data = handle.read()
        handle.close()
        assert path.exists() or (data and not data.strip(b"\0")), path
    fresh = bus.consumer("fresh", [TOPIC])
    got = read_all(fresh, 25 - kept[0])
    assert [r.offset for r in got] == list(range(kept[0], 25))  # offsets are stable across the expiry
    assert [r.value for r in got][-5:] == [b"new-%03d" % i for i in range(5)]  # nothing unexpired is lost
    slow = read_all(reader, 5)  # the reader whose segment was erased seeks on to what is kept
    assert [r.value for r in slow][-5:] == [b"new-%03d" % i for i in range(5)]
    fresh.commit(got)
    assert bus.lag("fresh", [TOPIC]) == {TOPIC: 0} and bus.lag("nobody", [TOPIC]) == {TOPIC: 25 - kept[0]}
    reader.close()
    fresh.close()


def test_an_expired_newest_segment_is_sealed_then_erased_and_offsets_go_on(tmp_path) -> None:
    bus = LocalLogBus(tmp_path, partitions=1, retention_s=60)
    send(bus, [b"only-%d" % i for i in range(3)])
    path = bus.topic_dir(TOPIC) / "0.log"
    past = time.time() - 120
    os.utime(path, (past, past))
    size = path.stat().st_size
    assert bus.expire() == {"segments": 1, "bytes": size}
    assert not path.exists() and segment_bases(bus.topic_dir(TOPIC), 0) == [3]
    send(bus, [b"after"])
    consumer = bus.consumer("g", [TOPIC])
    got = read_all(consumer, 1)
    assert [(r.offset, r.value) for r in got] == [(3, b"after")]
    consumer.close()


def test_a_log_written_before_segments_is_read_and_continued(tmp_path) -> None:
    directory = tmp_path / "topics" / TOPIC
    directory.mkdir(parents=True)
    (directory / "meta.json").write_text(json.dumps({"partitions": 1}))
    frames = [encode_frame(i, "k", b"legacy-%d" % i, {}, int(time.time() * 1000)) for i in range(6)]
    (directory / "0.log").write_bytes(b"".join(frames))
    offsets = tmp_path / "groups" / "g" / TOPIC
    offsets.mkdir(parents=True)
    (offsets / "0.offset").write_text(json.dumps({"offset": 4, "position": sum(len(f) for f in frames[:4])}))
    bus = LocalLogBus(tmp_path, partitions=1, segment_bytes=1)  # every later record rolls a segment
    send(bus, [b"new-0", b"new-1"])
    consumer = bus.consumer("g", [TOPIC])
    got = read_all(consumer, 4)
    assert [(r.offset, r.value) for r in got] == [(4, b"legacy-4"), (5, b"legacy-5"), (6, b"new-0"), (7, b"new-1")]
    consumer.close()


def test_a_reader_holding_a_segment_being_erased_seeks_again_and_a_crashed_erasure_is_finished(tmp_path) -> None:
    from flywheel.bus.segments import ERASING, open_for_append, segment_path

    bus = LocalLogBus(tmp_path, partitions=1, segment_bytes=300, retention_s=3600)
    send(bus, [b"old-secret-%03d" % i for i in range(20)])
    directory = bus.topic_dir(TOPIC)
    bases = segment_bases(directory, 0)
    consumer = bus.consumer("g", [TOPIC])
    first = consumer.poll(timeout_s=2, max_records=1)  # holds segment 0 open, positioned inside it
    assert [r.offset for r in first] == [0]
    # the janitor killed mid-erasure: segment 0 renamed away and half overwritten, mid-frame
    victim = segment_path(directory, 0, bases[0])
    erasing = victim.with_name(victim.name + ERASING)
    os.rename(victim, erasing)
    size = erasing.stat().st_size
    with open(erasing, "r+b") as half:
        half.seek(size // 2 + 3)
        half.write(bytes(size - size // 2 - 3))
    rest: list = []
    deadline = time.monotonic() + 10
    while (not rest or rest[-1].offset < 19) and time.monotonic() < deadline:
        rest += consumer.poll(timeout_s=0.2)  # never a CorruptLogError: past the zeros it seeks again
    offsets = [r.offset for r in rest]
    # what was still whole in segment 0, then from segment 1 on, every record once, in order
    assert offsets[-(20 - bases[1]):] == list(range(bases[1], 20))
    assert offsets[:-(20 - bases[1])] == list(range(1, len(offsets) - (20 - bases[1]) + 1))
    assert bus.lag("g", [TOPIC]) == {TOPIC: 20 - bases[1]}
    # a producer that listed segment 0 before it went neither recreates it nor reuses its offsets
    fd, base, path = open_for_append(directory, 0, bases[0])
    os.close(fd)
    assert base == bases[-1] and not victim.exists()
    # the next expiry finishes the half-erased file: gone, its bytes zeroed
    data = erasing.read_bytes()
    assert b"old-secret-000" in data
    assert bus.expire(3600 * 24)["segments"] == 1 and not erasing.exists()
    send(bus, [b"new"])
    assert [r.offset for r in read_all(consumer, 1)] == [20]
    consumer.close()


def test_a_consumer_resuming_inside_a_segment_zeroed_as_it_opens_it_seeks_on(tmp_path, monkeypatch) -> None:
    """A group's committed position lies in segment 0; the janitor renames and zeroes that segment
    just after the new consumer opened it: the consumer seeks on to what is kept, never raising."""
    from flywheel.bus import locallog
    from flywheel.bus.segments import ERASING, segment_path

    bus = LocalLogBus(tmp_path, partitions=1, segment_bytes=300, retention_s=3600)
    send(bus, [b"old-secret-%03d" % i for i in range(20)])
    directory = bus.topic_dir(TOPIC)
    bases = segment_bases(directory, 0)
    first = bus.consumer("g", [TOPIC])
    got = read_all(first, 3)
    first.commit(got[:3])  # offset 3, a position inside segment 0
    assert bases[1] > 3
    first.close()
    victim = segment_path(directory, 0, bases[0])
    position = json.loads(next(tmp_path.rglob("groups/g/*/0.offset")).read_text())["position"]
    real_open = os.open

    def open_then_erase(path, flags, *args):  # the janitor, between the consumer's open and its read
        fd = real_open(path, flags, *args)
        if str(path) == str(victim) and victim.exists():
            erasing = victim.with_name(victim.name + ERASING)
            os.rename(victim, erasing)
            with open(erasing, "r+b") as zeroed:  # zeroed up to inside the frame at the committed position
                zeroed.write(bytes(position + 7))
        return fd

    monkeypatch.setattr(locallog.os, "open", open_then_erase)
    resumed = bus.consumer("g", [TOPIC])
    rest = read_all(resumed, 20 - bases[1])
    monkeypatch.undo()
    assert [r.offset for r in rest] == list(range(bases[1], 20))  # segment 0 went: on from what is kept
    resumed.close()


def test_kafka_topics_are_created_with_a_retention(kafka_bootstrap) -> None:
    from kafka.admin import ConfigResource, ConfigResourceType

    from flywheel.bus.kafka import KafkaBus
    from tests.fixtures.kafka import unique_prefix

    topic = f"{unique_prefix()}retained"
    bus = KafkaBus(kafka_bootstrap, 1, retention_ms=3_600_000)
    try:
        bus.ensure_topics([topic])
        admin = bus._admin_client()  # noqa: SLF001 (the bus's own admin client)
        found = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)], config_filter="all")
        configs = found["topic"][topic]
        assert configs["retention.ms"]["value"] == "3600000" and configs["segment.ms"]["value"] == "900000"
    finally:
        bus.close()
    assert KafkaBus(kafka_bootstrap, 1).topic_configs() == {}
