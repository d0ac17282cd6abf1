"""Bus conformance: every test runs against the local log and a real Kafka-protocol broker.

The semantics checked are the ones documented in ``flywheel.bus.base``: per-key order, durable
commits, at-least-once redelivery, group resume, rewind to the committed offsets, independent
groups, dead letters and exclusive partition ownership inside a group.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pytest

from flywheel.bus import (
    DLQ_ORIGIN_OFFSET,
    DLQ_ORIGIN_PARTITION,
    DLQ_ORIGIN_TOPIC,
    DLQ_REASON,
    Bus,
    Consumer,
    Record,
    dlq_topic,
    make_bus,
    partition_for_key,
)
from flywheel.settings import Settings
from testbed.procs import wait_for

pytestmark = pytest.mark.integration

DEADLINE_S = 30.0


def _wait(condition: Callable[[], bool], what: str, timeout_s: float = DEADLINE_S) -> None:
    wait_for(what, condition, timeout_s, 0.05, ignore=(), error=AssertionError)


def drain(consumer: Consumer, expected: int, *, settle_s: float = 0.5) -> list[Record]:
    """Poll until ``expected`` records arrived, then keep polling ``settle_s`` to catch extras."""
    out: list[Record] = []
    deadline = time.monotonic() + DEADLINE_S
    while len(out) < expected:
        assert time.monotonic() < deadline, f"got {len(out)} of {expected} records in {DEADLINE_S}s"
        out.extend(consumer.poll(0.5))
    end = time.monotonic() + settle_s
    while time.monotonic() < end:
        out.extend(consumer.poll(0.1))
    return out


def wait_assigned(consumer: Consumer, pairs: set[tuple[str, int]]) -> list[Record]:
    """Poll (keeping what arrives) until ``consumer`` owns ``pairs``."""
    got: list[Record] = []
    deadline = time.monotonic() + DEADLINE_S
    while consumer.assignment() != pairs:
        assert time.monotonic() < deadline, f"assignment {consumer.assignment()} never became {pairs}"
        got.extend(consumer.poll(0.2))
    return got


def ids(records: list[Record]) -> list[tuple[int, int]]:
    return [(r.partition, r.offset) for r in records]


@pytest.fixture
def bus(bus_settings: Settings):
    bus = make_bus(bus_settings)
    yield bus
    bus.close()


def _topic(settings: Settings, bus: Bus, name: str = "events") -> str:
    topic = settings.topic(name)
    bus.ensure_topics([topic])
    return topic


def _produce(bus: Bus, topic: str, items: list[tuple[str, bytes]], headers: dict[str, str] | None = None) -> None:
    producer = bus.producer()
    try:
        for key, value in items:
            producer.send(topic, key, value, headers)
        producer.flush()
    finally:
        producer.close()


def test_per_key_order_and_partitioning(bus_settings: Settings, bus: Bus) -> None:
    topic = _topic(bus_settings, bus)
    rng = random.Random()
    keys = [f"session-{uuid.uuid4().hex[:8]}" for _ in range(24)]
    counters = dict.fromkeys(keys, 0)
    items = []
    for _ in range(240):  # interleaved: each record goes to a random key, numbered per key
        key = rng.choice(keys)
        items.append((key, f"{key}:{counters[key]}".encode()))
        counters[key] += 1
    _produce(bus, topic, items, headers={"h": "v"})

    consumer = bus.consumer("order", [topic])
    try:
        got = drain(consumer, len(items))
    finally:
        consumer.close()

    assert len(got) == len(items)
    assert len(set(ids(got))) == len(got)
    per_key: dict[str, list[int]] = defaultdict(list)
    for record in got:
        key, seq = record.value.decode().split(":")
        assert record.key == key and record.topic == topic and record.headers == {"h": "v"}
        assert record.partition == partition_for_key(key, bus_settings.bus.partitions)
        per_key[key].append(int(seq))
    assert {k: v for k, v in per_key.items()} == {k: list(range(n)) for k, n in counters.items() if n}
    by_partition: dict[int, list[int]] = defaultdict(list)
    for record in got:
        by_partition[record.partition].append(record.offset)
    for offsets in by_partition.values():
        assert offsets == sorted(offsets)


def test_caught_up_says_when_every_record_of_a_partition_was_returned(bus_settings: Settings, bus: Bus) -> None:
    topic = _topic(bus_settings, bus)
    key = "one-key"  # every record on one partition
    partition = partition_for_key(key, bus_settings.bus.partitions)
    _produce(bus, topic, [(key, f"v{i}".encode()) for i in range(30)])
    consumer = bus.consumer(f"caught-{uuid.uuid4().hex[:8]}", [topic])
    try:
        assert not consumer.caught_up(topic, partition)  # nothing fetched yet: not known
        got: list = []
        deadline = time.monotonic() + 60
        while not got and time.monotonic() < deadline:
            got = consumer.poll(0.5, max_records=10)
        assert len(got) == 10
        assert not consumer.caught_up(topic, partition)  # 20 records wait
        while len(got) < 30 and time.monotonic() < deadline:
            got += consumer.poll(0.5, max_records=10)
        assert len(got) == 30
        assert consumer.caught_up(topic, partition)
        _produce(bus, topic, [(key, b"one more")])
        more: list = []
        while not more and time.monotonic() < deadline:
            more = consumer.poll(0.5, max_records=10)
        assert [r.value for r in more] == [b"one more"] and consumer.caught_up(topic, partition)
    finally:
        consumer.close()


def test_uncommitted_records_are_redelivered(bus_settings: Settings, bus: Bus) -> None:
    topic = _topic(bus_settings, bus)
    items = [(f"k{i % 5}", f"v{i}".encode()) for i in range(20)]
    _produce(bus, topic, items)

    first = bus.consumer("alo", [topic])
    try:
        seen = drain(first, len(items))
    finally:
        first.close()  # no commit: nothing was processed

    again = make_bus(bus_settings)  # a restarted process
    second = again.consumer("alo", [topic])
    try:
        redelivered = drain(second, len(items))
    finally:
        second.close()
        again.close()
    assert sorted(ids(redelivered)) == sorted(ids(seen))
    assert sorted(r.value for r in redelivered) == sorted(v for _, v in items)


def test_commit_after_process_resumes_exactly_after_committed(bus_settings: Settings, bus: Bus) -> None:
    topic = _topic(bus_settings, bus)
    items = [(f"k{i % 7}", f"v{i}".encode()) for i in range(40)]
    _produce(bus, topic, items)

    consumer = bus.consumer("half", [topic])
    try:
        got = drain(consumer, len(items))
        per_partition: dict[int, list[Record]] = defaultdict(list)
        for record in got:
            per_partition[record.partition].append(record)
        processed = [r for recs in per_partition.values() for r in recs[: len(recs) // 2 + 1]]
        consumer.commit(processed)
    finally:
        consumer.close()

    expected = sorted(set(ids(got)) - set(ids(processed)))
    restarted = make_bus(bus_settings)
    consumer = restarted.consumer("half", [topic])
    try:
        rest = drain(consumer, len(expected), settle_s=1.0)
    finally:
        consumer.close()
        restarted.close()
    assert sorted(ids(rest)) == expected


def test_group_resumes_after_restart(bus_settings: Settings, bus: Bus) -> None:
    topic = _topic(bus_settings, bus)
    batch1 = [(f"a{i % 3}", f"one-{i}".encode()) for i in range(15)]
    batch2 = [(f"a{i % 3}", f"two-{i}".encode()) for i in range(15)]
    _produce(bus, topic, batch1)
    consumer = bus.consumer("resume", [topic])
    try:
        got = drain(consumer, len(batch1))
        consumer.commit(got)
    finally:
        consumer.close()
    bus.close()

    restarted = make_bus(bus_settings)
    try:
        _produce(restarted, topic, batch2)
        consumer = restarted.consumer("resume", [topic])
        try:
            got2 = drain(consumer, len(batch2), settle_s=1.0)
            consumer.commit(got2)
        finally:
            consumer.close()
    finally:
        restarted.close()
    assert sorted(r.value for r in got2) == sorted(v for _, v in batch2)


def _membership(consumer: Consumer) -> tuple[Any, ...]:
    """Who ``consumer`` is in its group; any leave, rejoin or rebalance changes it. Kafka: the
    generation and member id the coordinator gave it; local log: its member id and the owner lock
    (file descriptor) it holds for each partition."""
    from flywheel.bus.kafka import KafkaBusConsumer
    from flywheel.bus.locallog import LocalLogConsumer

    if isinstance(consumer, KafkaBusConsumer):
        generation = consumer._consumer._coordinator._generation
        return ("kafka", generation.generation_id, generation.member_id)
    assert isinstance(consumer, LocalLogConsumer)
    return ("local", consumer._member.member_id, sorted((pair, s.owner_fd) for pair, s in consumer._owned.items()))


def by_partition(records: list[Record]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = defaultdict(list)
    for record in records:
        out[record.partition].append(record.offset)
    return dict(out)


def test_rewind_returns_to_the_committed_offsets_keeping_membership(bus_settings: Settings, bus: Bus) -> None:
    """What a worker does after a database outage: ``rewind``, then the next polls return exactly the
    records not committed, each partition in order from its committed offset (from the start where
    nothing was committed), while the consumer keeps its membership and partitions."""
    topic = _topic(bus_settings, bus)
    n = bus_settings.bus.partitions
    everything = {(topic, p) for p in range(n)}
    names = (f"rw-{j}" for j in itertools.count())
    keys = {}
    while len(keys) < n:  # one key per partition, so every partition holds records
        key = next(names)
        keys.setdefault(partition_for_key(key, n), key)
    first = [(keys[i % n], f"a{i}".encode()) for i in range(12 * n)]
    _produce(bus, topic, first)
    consumer = bus.consumer(f"rewind-{uuid.uuid4().hex[:8]}", [topic])
    try:
        got = wait_assigned(consumer, everything)
        got += drain(consumer, len(first) - len(got))
        member = _membership(consumer)
        polled = {p: [r for r in got if r.partition == p] for p in range(n)}
        # Partition 0: nothing committed; 1: all of it; the others a different share each.
        committed = [r for p, records in polled.items() for r in records[: (0 if p == 0 else len(records) if p == 1
                                                                              else p * len(records) // (n + 1))]]
        consumer.commit(committed)
        second = [(keys[i % n], f"b{i}".encode()) for i in range(5 * n)]
        _produce(bus, topic, second)
        got += drain(consumer, len(second))
        assert len(set(ids(got))) == len(got) == len(first) + len(second)

        consumer.rewind()
        expected = sorted(set(ids(got)) - set(ids(committed)))
        again = drain(consumer, len(expected), settle_s=1.0)
        assert by_partition(again) == by_partition([r for r in got if (r.partition, r.offset) in set(expected)])
        assert sorted(ids(again)) == expected  # each once, nothing committed among them
        assert {r.value for r in again} == {r.value for r in got if (r.partition, r.offset) in set(expected)}
        assert consumer.assignment() == everything and _membership(consumer) == member

        consumer.commit(again)  # processed this time: a rewind now has nothing to return
        consumer.rewind()
        assert drain(consumer, 0, settle_s=1.0) == []
        assert consumer.assignment() == everything and _membership(consumer) == member
    finally:
        consumer.close()


def test_independent_groups_each_see_everything(bus_settings: Settings, bus: Bus) -> None:
    topic = _topic(bus_settings, bus)
    items = [(f"g{i % 4}", f"v{i}".encode()) for i in range(25)]
    _produce(bus, topic, items)
    results: dict[str, list[Record]] = {}
    errors: list[BaseException] = []

    def read(group: str) -> None:
        consumer = bus.consumer(group, [topic])
        try:
            results[group] = drain(consumer, len(items))
            consumer.commit(results[group])
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
        finally:
            consumer.close()

    threads = [threading.Thread(target=read, args=(group,)) for group in ("ingest", "audit")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for group in ("ingest", "audit"):
        assert sorted(r.value for r in results[group]) == sorted(v for _, v in items)


def test_dead_letters_carry_reason_and_origin(bus_settings: Settings, bus: Bus) -> None:
    topic = _topic(bus_settings, bus)
    _produce(bus, topic, [("s1", b'{"ok": 1}'), ("s1", b"\xffnot json"), ("s1", b'{"ok": 2}')], headers={"trace": "t1"})

    consumer = bus.consumer("dl", [topic])
    try:
        got = drain(consumer, 3)
        bad = [r for r in got if r.value.startswith(b"\xff")]
        assert len(bad) == 1
        consumer.dead_letter(bad[0], "undecodable: invalid JSON")
        consumer.commit(got)  # the bad record is handled: it must not block its neighbours
    finally:
        consumer.close()

    reader = bus.consumer("dl-reader", [dlq_topic(topic)])
    try:
        letters = drain(reader, 1, settle_s=1.0)
    finally:
        reader.close()
    assert len(letters) == 1
    letter = letters[0]
    assert letter.topic == dlq_topic(topic)
    assert letter.value == b"\xffnot json" and letter.key == "s1"
    assert letter.headers == {
        "trace": "t1",
        DLQ_REASON: "undecodable: invalid JSON",
        DLQ_ORIGIN_TOPIC: topic,
        DLQ_ORIGIN_PARTITION: str(bad[0].partition),
        DLQ_ORIGIN_OFFSET: str(bad[0].offset),
    }

    # The origin group committed all three: after a restart the next record on that partition
    # (same key) is the first thing it gets.
    _produce(bus, topic, [("s1", b"next")])
    consumer = bus.consumer("dl", [topic])
    try:
        assert [r.value for r in drain(consumer, 1)] == [b"next"]
    finally:
        consumer.close()


class _Member(threading.Thread):
    """A group member in its own thread: poll, remember, commit (the worker loop)."""

    def __init__(self, bus: Bus, group: str, topic: str) -> None:
        super().__init__(daemon=True)
        self.consumer = bus.consumer(group, [topic])
        self.records: list[Record] = []
        self.owned: set[tuple[str, int]] = set()
        self.owned_when: list[tuple[set[tuple[str, int]], list[tuple[int, int]]]] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                batch = self.consumer.poll(0.2)
                owned = self.consumer.assignment()
                self.owned_when.append((owned, ids(batch)))
                self.records.extend(batch)
                self.consumer.commit(batch)
                self.owned = owned
        except BaseException as exc:  # reported by the main thread
            self.error = exc
        finally:
            self.consumer.close()


def test_one_group_splits_partitions_and_never_double_delivers(bus_settings: Settings, bus: Bus) -> None:
    topic = _topic(bus_settings, bus)
    everything = {(topic, p) for p in range(bus_settings.bus.partitions)}
    a = _Member(bus, "split", topic)
    a.start()
    _wait(lambda: a.owned == everything or a.error is not None, "the first member to own every partition")
    b = _Member(bus, "split", topic)
    b.start()
    try:

        def split() -> bool:
            return bool(a.owned) and bool(b.owned) and not (a.owned & b.owned) and a.owned | b.owned == everything

        _wait(lambda: split() or a.error is not None or b.error is not None, "the group to split the partitions")
        assert a.error is None and b.error is None
        time.sleep(1.0)  # the split is stable, not a passing state
        assert split(), (a.owned, b.owned)

        items = [(f"key-{i % 40}", f"v{i}".encode()) for i in range(200)]
        _produce(bus, topic, items)
        _wait(lambda: len(a.records) + len(b.records) >= len(items), "every record to be consumed")
        time.sleep(1.0)
        assert a.error is None and b.error is None
        got_a, got_b = set(ids(a.records)), set(ids(b.records))
        assert len(got_a) == len(a.records) and len(got_b) == len(b.records), "a member saw a record twice"
        assert not got_a & got_b, "one record went to both members of a group"
        assert len(got_a | got_b) == len(items)
        assert got_a and got_b, "the group did not share the work"
        for member in (a, b):  # every record came from a partition the member owned at that poll
            for owned, batch in member.owned_when:
                assert {(topic, p) for p, _ in batch} <= owned

        # Failover: when b leaves, a takes over all partitions and gets what b would have.
        b.stop.set()
        b.join(DEADLINE_S)
        assert b.error is None
        _wait(lambda: a.owned == everything or a.error is not None, "the survivor to own every partition")
        before = len(a.records)
        more = [(f"key-{i % 40}", f"w{i}".encode()) for i in range(40)]
        _produce(bus, topic, more)
        _wait(lambda: len(a.records) - before >= len(more), "the survivor to get the new records")
        assert sorted(r.value for r in a.records[before:]) == sorted(v for _, v in more)
    finally:
        for member in (a, b):
            member.stop.set()
        for member in (a, b):
            if member.is_alive():
                member.join(DEADLINE_S)
    assert a.error is None and b.error is None


def test_kafka_flush_raises_when_the_broker_is_gone(tmp_path) -> None:
    """``send`` only enqueues; an unacknowledged record must surface as an error, never vanish."""
    from flywheel.bus import BusError
    from testbed.broker import start_tansu
    from tests.fixtures.kafka import kafka_test_settings

    broker = start_tansu(log_dir=tmp_path)
    try:
        settings = kafka_test_settings(broker.bootstrap, tmp_path)
        bus = make_bus(settings)
        topic = _topic(settings, bus)
        producer = bus.producer()
        producer.send(topic, "k", b"acknowledged")
        producer.flush(timeout_s=10)
        bus.close()
        broker.kill()  # a crash: no goodbye to the clients
        producer.send(topic, "k", b"never acknowledged")
        with pytest.raises(BusError):
            producer.flush(timeout_s=2)
        with pytest.raises(BusError):
            producer.close(timeout_s=0.5)
    finally:
        broker.stop()


def test_large_records_cross_the_bus_whole_in_an_envelope(bus_settings: Settings, bus: Bus) -> None:
    """Above the record limit a value is compressed, then chunked; a consumer gets it back bit-exact."""
    import hashlib
    import os

    from flywheel.bus.envelope import Reassembler, encode

    topic = _topic(bus_settings, bus)
    values = [os.urandom(3_000_000), b"[" + b"12345, " * 300_000 + b"]", b"small"]
    producer = bus.producer(timeout_s=10)
    try:
        for i, value in enumerate(values):
            for part, headers in encode(value, {"event_id": f"e{i}"}, 900_000):
                producer.send(topic, "one-key", part, headers)
        producer.flush(timeout_s=30)
    finally:
        producer.close()
    consumer = bus.consumer(f"g-{uuid.uuid4().hex[:8]}", [topic])
    reassembler = Reassembler()
    got: list[Record] = []
    try:
        deadline = time.monotonic() + DEADLINE_S
        while len(got) < len(values):
            assert time.monotonic() < deadline, f"got {len(got)} of {len(values)} values"
            got.extend(r for r in map(reassembler.feed, consumer.poll(0.5)) if r is not None)
    finally:
        consumer.close()
    assert [r.headers for r in got] == [{"event_id": f"e{i}"} for i in range(len(values))]
    assert [hashlib.sha256(r.value).digest() for r in got] == [hashlib.sha256(v).digest() for v in values]


def test_kafka_producer_gives_up_within_its_timeout_on_a_dead_broker(tmp_path) -> None:
    """Creating a producer, waiting for metadata and flushing are bounded by ``timeout_s``; none hangs."""
    from flywheel.bus import BusError
    from testbed.broker import start_tansu
    from testbed.procs import free_port
    from tests.fixtures.kafka import kafka_test_settings

    dead = make_bus(kafka_test_settings(f"127.0.0.1:{free_port()}", tmp_path))
    start = time.monotonic()
    with pytest.raises(BusError):
        dead.producer(timeout_s=2)
    assert time.monotonic() - start < 8

    broker = start_tansu(log_dir=tmp_path)
    try:
        settings = kafka_test_settings(broker.bootstrap, tmp_path)
        bus = make_bus(settings)
        producer = bus.producer(timeout_s=2)
        broker.kill()
        start = time.monotonic()
        with pytest.raises(BusError):  # metadata for a topic it has never seen: bounded by max_block_ms
            producer.send(settings.topic("never-seen"), "k", b"v")
            producer.flush(timeout_s=2)
        assert time.monotonic() - start < 8
        producer.close(timeout_s=0)
        bus.close()
    finally:
        broker.stop()
