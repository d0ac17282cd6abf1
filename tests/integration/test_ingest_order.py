"""Ingest with events out of order, twice, late, invalid, and replayed: on PostgreSQL and SQLite,
the local log and a Kafka-protocol broker.

These tests drive one ``Ingestor`` batch by batch (``process``, ``close_inactive``,
``emit_pending``: exactly what ``ingest.worker.run`` calls) over real consumers, so each test
chooses which records a batch holds: feedback before its generations, a duplicate in a later
batch, a poison record in the middle of valid ones.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, text

from flywheel.bus import DLQ_REASON, Consumer, Record, dlq_topic, make_bus
from flywheel.db.models import Trajectory
from flywheel.db.session import make_engine, make_session_factory, upgrade
from flywheel.events import FeedbackEvent, GenerationEvent, TrajectoryEvent
from flywheel.settings import Settings, load_settings
from ingest.worker import Ingestor
from tests.fixtures.kafka import kafka_test_settings, local_test_settings
from tests.fixtures.traffic import (
    FAST_KAFKA_GROUPS_IN_PROCESS,
    SessionTraffic,
    all_events,
    check_pipeline,
    count,
    db_snapshot,
    feedback,
    generation,
    make_traffic,
    produce,
    read_topic,
    topic_size,
    wait_for,
)

pytestmark = pytest.mark.integration

HORIZON_S = 60.0


def settings_for(bus_settings: Settings, db_url: str, **ingest: Any) -> Settings:
    base = bus_settings.model_dump(mode="json")
    if base["bus"]["kind"] == "kafka":  # a new group's first join in about a second, not three
        base["bus"].update(FAST_KAFKA_GROUPS_IN_PROCESS)
    return load_settings(None, **{**base, "db": {"url": db_url, "wait_s": 10},
                                  "ingest": {"late_horizon_s": HORIZON_S, **ingest}})


class Harness:
    """One ingestor and the consumers a test reads with; everything closed at the end."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.engine = make_engine(settings.database_url)
        self.bus = make_bus(settings)
        self.bus.ensure_topics([settings.topic(t) for t in ("generations", "feedback", "trajectories")])
        self.producer = self.bus.producer()
        self.ingestor = Ingestor(settings, make_session_factory(self.engine), self.producer)
        self.consumers: dict[str, Consumer] = {}
        self._topics: dict[int, list[str]] = {}  # id(consumer) -> its topics
        self._returned: dict[int, int] = {}  # id(consumer) -> records its polls returned so far

    def consumer(self, group: str, *names: str) -> Consumer:
        if group not in self.consumers:
            consumer = self.consumers[group] = self.bus.consumer(group, [self.settings.topic(n) for n in names])
            self._topics[id(consumer)] = [self.settings.topic(n) for n in names]
            self._returned[id(consumer)] = 0
        return self.consumers[group]

    def drain(self, consumer: Consumer, expected: int) -> list[Record]:
        """The next ``expected`` records, and proof there are no more: every consumer here reads its
        topics once from offset 0 in a group of its own, so all it returned equals all they hold."""
        out: list[Record] = []
        wait_for(f"{expected} records", lambda: out.extend(consumer.poll(0.3, 1000)) or len(out) >= expected, 60,
                 every_s=0)
        self._returned[id(consumer)] += len(out)
        held = sum(topic_size(self.settings, topic) for topic in self._topics[id(consumer)])
        assert len(out) == expected and self._returned[id(consumer)] == held, (
            f"more records than expected: {len(out)} returned, {expected} expected; "
            f"{self._returned[id(consumer)]} returned in all, {held} on the topics")
        return out

    def ingest(self, consumer: Consumer, records: Sequence[Record], batch: int = 500) -> None:
        for i in range(0, len(records), batch):
            chunk = records[i : i + batch]
            self.ingestor.process(chunk, consumer)
            consumer.commit(self.ingestor.committable(chunk, consumer))

    def close(self) -> None:
        for consumer in self.consumers.values():
            consumer.close()
        self.producer.close()
        self.bus.close()
        self.engine.dispose()


@pytest.fixture(params=["local-sqlite", "local-postgresql", "kafka-postgresql"])
def harness(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    """Both databases on the local log, and the Kafka-protocol broker on PostgreSQL: the bus and
    the database never meet in these tests (one in-process ingestor), so their cross product
    would prove nothing more."""
    bus_kind, db = request.param.split("-")
    db_url = request.getfixturevalue("pg_url" if db == "postgresql" else "sqlite_url")
    upgrade(db_url)
    if bus_kind == "kafka":
        bus = kafka_test_settings(request.getfixturevalue("kafka_bootstrap"), tmp_path)
    else:
        bus = local_test_settings(tmp_path)
    h = Harness(settings_for(bus, db_url))
    yield h
    h.close()


@pytest.fixture
def local_harness(local_bus_settings: Settings, migrated_db_url: str) -> Iterator[Harness]:
    h = Harness(settings_for(local_bus_settings, migrated_db_url))
    yield h
    h.close()


def statuses(h: Harness) -> dict[str, int]:
    with h.engine.connect() as conn:
        return dict(conn.execute(text("SELECT status, count(*) FROM sessions GROUP BY status")).all())


def revisions(h: Harness, session_id: str) -> list[tuple[int, str, int, int]]:
    """(revision, closed reason, turns, feedback) of each stored revision of a session."""
    with h.engine.connect() as conn:
        rows = conn.execute(select(Trajectory.revision, Trajectory.closed_reason, Trajectory.payload)
                            .where(Trajectory.session_id == session_id).order_by(Trajectory.revision)).all()
    out = []
    for revision, reason, payload in rows:
        traj = TrajectoryEvent.model_validate(payload)
        out.append((revision, reason, len(traj.generation_ids), len(traj.feedback)))
    return out


def test_feedback_read_before_its_generations_closes_each_session_once(harness: Harness) -> None:
    traffic = make_traffic(30, seed=1, outcome_share=1.0)
    produce(harness.settings, all_events(traffic))
    n_fb = sum(len(s.feedback) for s in traffic)
    n_gen = sum(len(s.generations) for s in traffic)

    feedback_first = harness.consumer("ingest-fb", "feedback")
    harness.ingest(feedback_first, harness.drain(feedback_first, n_fb))
    assert statuses(harness) == {"empty": len(traffic)}  # outcomes with nothing to train on yet
    assert count(harness.engine, Trajectory) == 0

    generations = harness.consumer("ingest-gen", "generations")
    harness.ingest(generations, harness.drain(generations, n_gen))
    # Each session closes the moment its generations arrive (its outcome is already there), with
    # every turn and every feedback: one revision, no wait for the inactivity timeout.
    assert statuses(harness) == {"closed": len(traffic)}
    checked = check_pipeline(harness.settings, traffic)
    assert checked.revisions == {"outcome": len(traffic)} and checked.max_revision == 0
    assert harness.ingestor.counters["sessions_reopened"] == len(traffic)


def test_producer_retries_and_late_feedback_inside_and_after_the_horizon(harness: Harness) -> None:
    traffic = make_traffic(24, seed=2, start=_an_hour_ago())
    events = all_events(traffic)
    produce(harness.settings, events)
    consumer = harness.consumer("ingest", "generations", "feedback")
    harness.ingest(consumer, harness.drain(consumer, len(events)))  # one batch: one revision per session
    harness.ingestor.close_inactive()  # the sessions without an outcome (their events are an hour old)
    first = check_pipeline(harness.settings, traffic)
    assert first.max_revision == 0 and sum(first.revisions.values()) == len(traffic)
    before = db_snapshot(harness.engine)

    produce(harness.settings, random.Random(2).sample(events, len(events)))  # every event again, any order
    harness.ingest(consumer, harness.drain(consumer, len(events)), batch=37)
    harness.ingestor.close_inactive()
    assert db_snapshot(harness.engine) == before
    counters = harness.ingestor.counters
    assert counters["duplicate_generations"] == sum(len(s.generations) for s in traffic)
    assert counters["duplicate_feedback"] == sum(len(s.feedback) for s in traffic)

    # Late feedback, in event time from the newest event of the closed trajectory:
    # 30 s after it re-opens (revision 1, late_feedback), 2 x the horizon after it is only stored.
    solved, idle = _with_outcome(traffic), _without_outcome(traffic)
    late_ok = [_late(s, "late-in", seconds=HORIZON_S / 2) for s in (solved, idle)]
    too_late = _late(traffic[0], "late-out", seconds=2 * HORIZON_S)
    produce(harness.settings, [*late_ok, too_late, *late_ok, too_late])  # retried, too
    harness.ingest(consumer, harness.drain(consumer, 6), batch=3)
    assert [r[:2] for r in revisions(harness, solved.session_id)] == [(0, "outcome"), (1, "late_feedback")]
    assert [r[:2] for r in revisions(harness, idle.session_id)] == [(0, "inactivity"), (1, "late_feedback")]
    for session, fb in zip((solved, idle), late_ok):
        session.feedback.append(fb)
    traffic[0].feedback.append(too_late)
    assert counters["feedback_expired"] == 1 and counters["feedback_late"] == 2
    checked = check_pipeline(harness.settings, traffic, expired={too_late.feedback_id})
    assert checked.max_revision == 1 and sum(checked.revisions.values()) == len(traffic) + 2


def test_replaying_every_topic_from_the_start_changes_nothing(harness: Harness) -> None:
    traffic = make_traffic(20, seed=3, start=_an_hour_ago())
    late = _late(_with_outcome(traffic), "late-in", seconds=10)
    expired = _late(_without_outcome(traffic), "late-out", seconds=2 * HORIZON_S)
    bad = [("generations", "bad-1", b"\x00 not json"), ("feedback", "bad-2", b'{"tenant": "acme"}')]
    produce(harness.settings, all_events(traffic), raw=bad)
    consumer = harness.consumer("ingest", "generations", "feedback")
    harness.ingest(consumer, harness.drain(consumer, len(all_events(traffic)) + 2), batch=50)
    harness.ingestor.close_inactive()
    produce(harness.settings, [late, expired])
    harness.ingest(consumer, harness.drain(consumer, 2))
    _with_outcome(traffic).feedback.append(late)
    _without_outcome(traffic).feedback.append(expired)
    check_pipeline(harness.settings, traffic, expired={expired.feedback_id})
    before = db_snapshot(harness.engine)
    emitted = len(read_topic(harness.settings, harness.settings.topic("trajectories")))
    assert emitted == count(harness.engine, Trajectory)

    replay = harness.consumer("ingest-replay", "generations", "feedback")  # a new group: from offset 0
    records = harness.drain(replay, len(all_events(traffic)) + len(bad))  # the late ones are in traffic now
    harness.ingest(replay, records, batch=7)
    harness.ingestor.close_inactive()
    harness.ingestor.emit_pending()
    assert db_snapshot(harness.engine) == before
    assert len(read_topic(harness.settings, harness.settings.topic("trajectories"))) == emitted


def test_invalid_events_go_to_the_dead_letter_topic_and_never_block_their_neighbours(harness: Harness) -> None:
    traffic = make_traffic(10, seed=4, start=_an_hour_ago())
    victim = traffic[0]
    rng = random.Random(4)
    g = victim.generations[-1]
    poison: list[tuple[str, bytes, str]] = [  # (topic, value, what the reason must say)
        ("generations", b"\xff\xfe not json", "undecodable GenerationEvent"),
        ("feedback", b'{"tenant": "acme", "session_id": "x", "kind": "outcome"}', "undecodable FeedbackEvent"),
        ("feedback", b'{"tenant": "acme", "session_id": "x", "feedback_id": "f", "kind": "explicit", "signal": "abandon"}',
         "is not a explicit signal"),
    ]
    too_long = {"model_line": "m" * 200, "node_id": "n" * 300, "model_version": 2**31,
                "sampling": {"temperature": 1.0, "top_p": 1.5}}
    for i, (name, value) in enumerate(too_long.items()):
        bad = generation(victim.tenant, victim.session_id, f"bad-{i}", g.prompt_token_ids, [1, 2], g.ts, rng, **{name: value})
        poison.append(("generations", bad.to_bytes(), "invalid GenerationEvent"))
    reasons = {"model_line": "model_line has 200 characters", "node_id": "node_id has 300 characters",
               "model_version": "does not fit a 32-bit integer", "sampling": "top_p"}
    events = all_events(traffic)
    # The poison sits in the middle of the valid events of the same sessions, in the same batch.
    produce(harness.settings, events[: len(events) // 2],
            raw=[(topic, victim.session_id, value) for topic, value, _ in poison])
    produce(harness.settings, events[len(events) // 2 :])
    consumer = harness.consumer("ingest", "generations", "feedback")
    harness.ingest(consumer, harness.drain(consumer, len(events) + len(poison)))
    harness.ingestor.close_inactive()
    check_pipeline(harness.settings, traffic)

    dead = [*read_topic(harness.settings, dlq_topic(harness.settings.topic("generations"))),
            *read_topic(harness.settings, dlq_topic(harness.settings.topic("feedback")))]
    assert sorted(r.value for r in dead) == sorted(value for _, value, _ in poison)
    got = {r.value: r.headers[DLQ_REASON] for r in dead}
    for _, value, expected in poison:
        assert expected in got[value], got[value]
    for name, expected in reasons.items():
        assert any(expected in reason for reason in got.values()), (name, sorted(got.values()))
    assert harness.ingestor.counters["dead_lettered"] == len(poison)


def test_a_record_the_database_refuses_is_dead_lettered_alone(local_harness: Harness) -> None:
    """Should the database refuse an event the checks let through, its batch is written again
    one event per transaction, and only the refused event goes to the dead-letter topic."""
    h = local_harness
    with h.engine.begin() as conn:  # a rule only the database knows, as a stand-in for the unforeseen
        if h.engine.dialect.name == "postgresql":
            conn.execute(text("ALTER TABLE generations ADD CONSTRAINT ck_test_refused CHECK (node_id <> 'refused')"))
        else:
            conn.execute(text("CREATE TRIGGER refuse BEFORE INSERT ON generations WHEN NEW.node_id = 'refused' "
                              "BEGIN SELECT RAISE(ABORT, 'refused by a test trigger'); END"))
    traffic = make_traffic(12, seed=5, start=_an_hour_ago())
    g = traffic[3].generations[0]
    refused = generation(g.tenant, g.session_id, "refused-1", g.prompt_token_ids, [7, 8], g.ts, random.Random(5),
                         node_id="refused")
    events = all_events(traffic)
    produce(h.settings, [*events[:10], refused, *events[10:]])
    consumer = h.consumer("ingest", "generations", "feedback")
    h.ingest(consumer, h.drain(consumer, len(events) + 1))
    h.ingestor.close_inactive()
    check_pipeline(h.settings, traffic)
    dead = read_topic(h.settings, dlq_topic(h.settings.topic("generations")))
    assert [GenerationEvent.from_bytes(r.value).generation_id for r in dead] == ["refused-1"]
    assert "refused by the database" in dead[0].headers[DLQ_REASON]
    assert h.ingestor.counters["batches_split"] == 1


class _Unreachable:
    """A producer whose broker is down: the close commits, the trajectory stays in the outbox."""

    def send(self, topic: str, key: str, value: bytes, headers: dict[str, str] | None = None) -> None:
        raise ConnectionError("broker unreachable")

    def flush(self, timeout_s: float | None = None) -> None:
        raise ConnectionError("broker unreachable")

    def close(self, timeout_s: float | None = None) -> None:
        pass


def test_a_session_leaving_the_outbox_still_emits_every_revision(local_harness: Harness) -> None:
    """Late feedback or a new turn for a session whose trajectory is committed (``closing``) but
    not yet on the bus: that revision is emitted before the session moves on; none is skipped."""
    h = local_harness
    traffic = make_traffic(2, seed=6, start=_an_hour_ago(), outcome_share=1.0)
    produce(h.settings, all_events(traffic))
    consumer = h.consumer("ingest", "generations", "feedback")
    records = h.drain(consumer, len(all_events(traffic)))
    down = Ingestor(h.settings, make_session_factory(h.engine), _Unreachable())
    with pytest.raises(ConnectionError):
        down.process(records, consumer)
    assert statuses(h) == {"closing": 2}

    a, b = traffic
    late = _late(a, "late-in", seconds=5)
    a.feedback.append(late)
    last = b.generations[-1]
    more = generation(b.tenant, b.session_id, "g-more", last.prompt_token_ids + last.completion_token_ids + [5],
                      [9, 9, 9], b.feedback[-1].ts + timedelta(seconds=5), random.Random(6))
    b.generations.append(more)
    produce(h.settings, [late, more])
    h.ingest(consumer, h.drain(consumer, 2))  # the records of the failed batch were never committed: only these
    h.ingestor.close_inactive()  # b's new turn came after its outcome: it waits for inactivity
    assert [r[:2] for r in revisions(h, a.session_id)] == [(0, "outcome"), (1, "late_feedback")]
    assert [r[:2] for r in revisions(h, b.session_id)] == [(0, "outcome"), (1, "inactivity")]
    checked = check_pipeline(h.settings, traffic)
    assert checked.bus_records == 4  # both revisions of both sessions, each once


def test_a_turn_that_arrives_after_the_outcome_that_ended_its_session(local_harness: Harness) -> None:
    """A turn served before the outcome but read after it closes the session again at once
    (revision 1, reason outcome); a turn served after the outcome re-opens it until inactivity."""
    h = local_harness
    session = make_traffic(1, seed=7, start=_an_hour_ago(), turns=(3, 3), outcome_share=1.0)[0]
    straggler = session.generations.pop(1)
    produce(h.settings, session.events)
    consumer = h.consumer("ingest", "generations", "feedback")
    h.ingest(consumer, h.drain(consumer, len(session.events)))
    assert revisions(h, session.session_id) == [(0, "outcome", 2, len(session.feedback))]

    produce(h.settings, [straggler])
    h.ingest(consumer, h.drain(consumer, 1))
    session.generations.insert(1, straggler)
    assert revisions(h, session.session_id)[1] == (1, "outcome", 3, len(session.feedback))

    outcome = session.feedback[-1]
    last = session.generations[-1]
    after = generation(session.tenant, session.session_id, "g-after", last.prompt_token_ids + last.completion_token_ids,
                       [4, 4], outcome.ts + timedelta(seconds=1), random.Random(7))
    produce(h.settings, [after])
    h.ingest(consumer, h.drain(consumer, 1))
    session.generations.append(after)
    assert statuses(h) == {"open": 1}
    h.ingestor.close_inactive()
    assert revisions(h, session.session_id)[2] == (2, "inactivity", 4, len(session.feedback))
    check_pipeline(h.settings, [session])


# --- helpers -------------------------------------------------------------------------------------


def _an_hour_ago() -> datetime:
    return datetime.now(UTC) - timedelta(hours=1)


def _with_outcome(traffic: Sequence[SessionTraffic]) -> SessionTraffic:
    return next(s for s in traffic if s.feedback and s.feedback[-1].kind == "outcome")


def _without_outcome(traffic: Sequence[SessionTraffic]) -> SessionTraffic:
    return next(s for s in traffic if not any(f.kind == "outcome" for f in s.feedback))


def _late(session: SessionTraffic, tag: str, *, seconds: float) -> FeedbackEvent:
    """Feedback ``seconds`` after the session's newest event (in event time)."""
    newest = max(e.ts for e in session.events)
    return feedback(session.tenant, session.session_id, f"{tag}-{session.session_id}", "explicit", "rating", 4.0,
                    newest + timedelta(seconds=seconds))


def test_the_inactivity_sweep_closes_only_sessions_on_partitions_this_worker_owns(local_harness: Harness) -> None:
    """A worker that has caught up must not close a session whose generations partition another
    worker owns (that worker may still hold its newer events); any worker closes an orphan."""
    from flywheel.bus import partition_for_key

    h = local_harness
    traffic = make_traffic(16, seed=8, start=_an_hour_ago(), outcome_share=0.0)
    produce(h.settings, all_events(traffic))
    consumer = h.consumer("ingest", "generations", "feedback")
    h.ingest(consumer, h.drain(consumer, len(all_events(traffic))))
    n = h.settings.bus.partitions
    home = {s.session_id: partition_for_key(s.session_id, n) for s in traffic}
    assert len(set(home.values())) > 1
    def worker(orphan_timeout_s: float) -> Ingestor:
        settings = load_settings(None, **{**h.settings.model_dump(mode="json"), "ingest": {
            "inactivity_timeout_s": 1.0, "orphan_timeout_s": orphan_timeout_s}})
        return Ingestor(settings, make_session_factory(h.engine), h.producer)

    mine = {0}
    assert worker(7200).close_inactive(owned=mine) == sum(1 for p in home.values() if p in mine)
    assert {s for s, p in home.items() if p in mine} == {r.session_id for r in _closed(h)}
    assert worker(7200).close_inactive(owned=set()) == 0  # an hour idle: not an orphan after 2 h
    assert worker(1800).close_inactive(owned=set()) == sum(1 for p in home.values() if p not in mine)
    check_pipeline(h.settings, traffic)


def _closed(h: Harness) -> list[Any]:
    with h.engine.connect() as conn:
        return conn.execute(text("SELECT session_id FROM sessions WHERE status = 'closed'")).all()
