"""Bus lag on both backends: ``Bus.lag`` counts what a group has not committed, without disturbing it.

Checked against the local log and a real Kafka-protocol broker (``bus_settings``): N records, k of
them committed, lag N - k; a group that never committed, lag N; lag leaves the group's membership,
partitions and committed offsets as they were, and its consumer goes on as if lag had not been
called. ``stage_lags`` uses the groups and topics of ``Settings.group`` / ``Settings.stage_topics``.
A backend that cannot answer raises ``BusError``.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from flywheel.bus import Bus, BusError, Consumer, Record, make_bus
from flywheel.bus.base import stage_lags
from flywheel.settings import STAGE_TOPICS, Settings
from testbed.procs import free_port
from tests.integration.test_bus import drain

pytestmark = pytest.mark.integration



@pytest.fixture
def bus(bus_settings: Settings):
    bus = make_bus(bus_settings)
    yield bus
    bus.close()


def produce(bus: Bus, topic: str, n: int, tag: str = "v") -> None:
    producer = bus.producer()
    try:
        for i in range(n):
            producer.send(topic, f"key-{i % 11}", f"{tag}{i}".encode())
        producer.flush()
    finally:
        producer.close()


def first_part_of_each_partition(records: list[Record]) -> list[Record]:
    """About the first third of each partition's records, in order (a commit of a prefix)."""
    per: dict[tuple[str, int], list[Record]] = defaultdict(list)
    for record in records:
        per[(record.topic, record.partition)].append(record)
    return [r for recs in per.values() for r in recs[: len(recs) // 3]]


def membership(consumer: Consumer) -> tuple[Any, ...]:
    """Who ``consumer`` is in its group (any leave, rejoin or rebalance changes it): Kafka's generation
    and member id, or the local log's member id and the owner lock held for each partition."""
    from flywheel.bus.kafka import KafkaBusConsumer
    from flywheel.bus.locallog import LocalLogConsumer

    if isinstance(consumer, KafkaBusConsumer):
        generation = consumer._consumer._coordinator._generation
        return ("kafka", generation.generation_id, generation.member_id, sorted(consumer.assignment()))
    assert isinstance(consumer, LocalLogConsumer)
    return ("local", consumer._member.member_id, sorted((pair, s.owner_fd) for pair, s in consumer._owned.items()))


def test_lag_is_what_the_group_has_not_committed(bus_settings: Settings, bus: Bus) -> None:
    one, two, absent = bus_settings.topic("one"), bus_settings.topic("two"), bus_settings.topic("absent")
    bus.ensure_topics([one, two])
    produce(bus, one, 40)
    produce(bus, two, 25)

    lagging, never = bus_settings.group("lagging"), bus_settings.group("never")
    assert bus.lag(never, [one, two, absent]) == {one: 40, two: 25, absent: 0}

    consumer = bus.consumer(lagging, [one, two])
    try:
        got = drain(consumer, 65)
        assert len(got) == 65
        assert bus.lag(lagging, [one, two]) == {one: 40, two: 25}  # polled is not committed
        done = first_part_of_each_partition(got)
        k = {t: sum(r.topic == t for r in done) for t in (one, two)}
        assert 0 < k[one] < 40 and 0 < k[two] < 25
        consumer.commit(done)
        assert bus.lag(lagging, [one, two]) == {one: 40 - k[one], two: 25 - k[two]}
        assert bus.lag(lagging, [two]) == {two: 25 - k[two]}
        assert bus.lag(never, [one, two]) == {one: 40, two: 25}  # another group's commits are not its own
    finally:
        consumer.close()


def test_lag_leaves_the_group_and_its_consumer_undisturbed(bus_settings: Settings, bus: Bus) -> None:
    topic = bus_settings.topic("events")
    bus.ensure_topics([topic])
    produce(bus, topic, 30)
    group = bus_settings.group("steady")
    consumer = bus.consumer(group, [topic])
    try:
        got = drain(consumer, 30)
        done = first_part_of_each_partition(got)
        consumer.commit(done)
        before = membership(consumer)
        everything = {(topic, p) for p in range(bus_settings.bus.partitions)}
        assert consumer.assignment() == everything

        other = make_bus(bus_settings)  # the console's own bus, as another process would have
        try:
            for _ in range(3):
                assert other.lag(group, [topic]) == {topic: 30 - len(done)}
            produce(bus, topic, 12, tag="more")
            assert other.lag(group, [topic]) == {topic: 42 - len(done)}

            # The consumer goes on where it was: only the new records, same membership and partitions.
            more = drain(consumer, 12, settle_s=1.0)
            assert sorted(r.value for r in more) == sorted(f"more{i}".encode() for i in range(12))
            assert membership(consumer) == before and consumer.assignment() == everything

            # The committed offsets are untouched: a rewind returns exactly what was not committed.
            consumer.rewind()
            again = drain(consumer, 42 - len(done), settle_s=1.0)
            committed = {(r.partition, r.offset) for r in done}
            assert sorted((r.partition, r.offset) for r in again) == sorted(
                (r.partition, r.offset) for r in got + more if (r.partition, r.offset) not in committed
            )
            consumer.commit(again)
            assert other.lag(group, [topic]) == {topic: 0}
            assert membership(consumer) == before
        finally:
            other.close()
    finally:
        consumer.close()


def test_stage_lags_uses_each_stage_group_and_topics(bus_settings: Settings, bus: Bus) -> None:
    counts = {"generations": 9, "feedback": 4, "trajectories": 7, "scored": 5}
    bus.ensure_topics([bus_settings.topic(name) for name in counts])
    for name, n in counts.items():
        produce(bus, bus_settings.topic(name), n)

    assert set(STAGE_TOPICS) == {"ingest", "rewards", "trainer"}
    expected = {
        stage: {bus_settings.topic(name): counts[name] for name in names} for stage, names in STAGE_TOPICS.items()
    }
    assert stage_lags(bus, bus_settings) == expected
    assert bus_settings.stage_topics("ingest") == [bus_settings.topic("generations"), bus_settings.topic("feedback")]

    scored = bus_settings.topic("scored")
    consumer = bus.consumer(bus_settings.group("trainer"), [scored])
    try:
        consumer.commit(drain(consumer, counts["scored"]))
    finally:
        consumer.close()
    expected["trainer"][scored] = 0
    assert stage_lags(bus, bus_settings) == expected


def test_a_local_log_that_cannot_be_read_raises_bus_error(local_bus_settings: Settings) -> None:
    bus = make_bus(local_bus_settings)
    topic = local_bus_settings.topic("events")
    produce(bus, topic, 6)
    consumer = bus.consumer("g", [topic])
    try:
        consumer.commit(drain(consumer, 6, settle_s=0.1)[:1])
    finally:
        consumer.close()
    assert sum(bus.lag("g", [topic]).values()) == 5

    offsets = sorted((Path(local_bus_settings.bus_log_path) / "groups" / "g" / topic).glob("*.offset"))
    assert offsets
    offsets[0].write_text("{not json")
    with pytest.raises(BusError):
        bus.lag("g", [topic])

    offsets[0].write_text(json.dumps({"offset": 0, "position": 0}))
    log = max((Path(local_bus_settings.bus_log_path) / "topics" / topic).glob("*.log"), key=lambda p: p.stat().st_size)
    data = bytearray(log.read_bytes())
    data[10] ^= 0xFF  # damage inside the first frame, with good frames after it
    log.write_bytes(bytes(data))
    with pytest.raises(BusError):
        make_bus(local_bus_settings).lag("g", [topic])  # a fresh bus counts from the start


def test_an_unreachable_broker_raises_bus_error() -> None:
    from flywheel.bus.kafka import KafkaBus

    bus = KafkaBus(f"127.0.0.1:{free_port()}", admin_timeout_ms=1_500)
    try:
        started = time.monotonic()
        with pytest.raises(BusError):
            bus.lag("g", ["t"])
        assert time.monotonic() - started < 15
    finally:
        bus.close()
