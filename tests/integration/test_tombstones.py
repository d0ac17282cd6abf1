"""Tombstones in flight (flywheel/tombstones.py): an erased subject's records that are still on the
bus when the erasure is asked are dropped by ingest, the rewards stage and the trainer; what the
user sends later in a session of its own is kept; and an erasure's second pass deletes what a stage
stored before it saw the tombstone. SQLite and PostgreSQL, the local log."""

from __future__ import annotations

import io
import random
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import func, select

from flywheel import erasure
from flywheel.bus import dlq_topic, make_bus
from flywheel.db.models import (
    Erasure,
    ErasureSession,
    Feedback,
    Generation,
    ScoredTrajectoryRow,
    TrainedTrajectory,
    Trajectory,
)
from flywheel.db.session import make_session_factory
from flywheel.events import ScoredTrajectory, TrajectoryEvent, trajectory_id_for
from flywheel.settings import Settings
from flywheel.subjects import Subject, export
from flywheel.tombstones import Tombstones
from ingest.assemble import assemble
from rewards.normalise import Normaliser
from rewards.scorer import Scorer
from rewards.spec import load_spec
from rewards.worker import process
from tests.fixtures.traffic import SessionTraffic, feedback, generation, produce, read_topic
from tests.integration.test_ingest_order import Harness, settings_for
from trainer.buffer import SampleBuffer

pytestmark = pytest.mark.integration

ALICE, BOB = "a" * 64, "b" * 64


@pytest.fixture
def harness(local_bus_settings: Settings, migrated_db_url: str) -> Iterator[Harness]:
    h = Harness(settings_for(local_bus_settings, migrated_db_url))
    yield h
    h.close()


def session(session_id: str, user: str | None, start: datetime, turns: int, rng: random.Random) -> SessionTraffic:
    s = SessionTraffic("acme", session_id)
    for turn in range(turns):
        gen = generation("acme", session_id, f"g-{session_id}-{turn}", [1, 2, 3], [4, 5], start + timedelta(seconds=turn),
                         rng, user_hash=user)
        s.generations.append(gen)
        s.feedback.append(feedback("acme", session_id, f"f-{session_id}-{turn}", "explicit", "thumbs", 1.0,
                                   gen.ts + timedelta(milliseconds=100), gen.generation_id))
    s.feedback.append(feedback("acme", session_id, f"o-{session_id}", "outcome", "task_solved", 1.0,
                               start + timedelta(seconds=turns)))
    return s


def ingested(h: Harness, session_id: str, start: datetime, rng: random.Random) -> Any:
    """Produce and ingest (store, close) one whole session of alice's; ingest's consumer."""
    traffic = session(session_id, ALICE, start, 1, rng)
    produce(h.settings, traffic.events)
    consumer = h.consumer("t-ingest", "generations", "feedback")
    h.ingest(consumer, h.drain(consumer, len(traffic.events)))
    return consumer


def rows(sessions, subject: Subject) -> dict[str, int]:
    return {kind: n for kind, n in export(sessions, subject, io.BytesIO()).items() if n}


def test_ingest_drops_an_erased_users_records_in_flight_and_keeps_their_later_sessions(harness: Harness) -> None:
    h, rng = harness, random.Random(7)
    sessions = make_session_factory(h.engine)
    before = datetime.now(UTC) - timedelta(seconds=30)
    in_flight = [session("a1", ALICE, before, 2, rng), session("a2", ALICE, before, 1, rng), session("b1", BOB, before, 2, rng)]
    erasure_id = erasure.request(sessions, Subject("acme", user_hash=ALICE), "dpo")  # nothing of alice stored yet
    later = datetime.now(UTC) + timedelta(seconds=1)
    # alice goes on in a1 (its prompt carries the erased turns) and starts a3 after the request
    a1_more = generation("acme", "a1", "g-a1-late", [1, 2, 3, 4, 5], [6], later, rng, user_hash=ALICE)
    a3 = session("a3", ALICE, later, 1, rng)
    events = [e for s in in_flight for e in s.events] + [a1_more, *a3.events]
    produce(h.settings, events)
    consumer = h.consumer("t-ingest", "generations", "feedback")
    h.ingest(consumer, h.drain(consumer, len(events)), batch=4)

    with sessions() as db:
        covered = set(db.scalars(select(ErasureSession.session_id).where(ErasureSession.erasure_id == erasure_id)))
        stored_sessions = set(db.scalars(select(Generation.session_id)))
        trajectories = set(db.scalars(select(Trajectory.session_id)))
        feedback_sessions = set(db.scalars(select(Feedback.session_id)))
    assert covered == {"a1", "a2"}  # found in flight: every stage drops them from now on
    assert stored_sessions == {"b1", "a3"} == trajectories == feedback_sessions
    with sessions() as db:  # feedback read before its session's generations is stored, then deleted with it
        deleted = db.get(Erasure, erasure_id).counts
    erased = sum(len(s.events) for s in in_flight[:2]) + 1
    assert h.ingestor.counters["erased"] + deleted.get("feedback", 0) == erased
    on_bus = {TrajectoryEvent.from_bytes(r.value).session_id for r in read_topic(h.settings, h.settings.topic("trajectories"))}
    assert on_bus == {"b1", "a3"}
    assert read_topic(h.settings, dlq_topic(h.settings.topic("generations")), timeout_s=1) == []


def test_an_erasure_committed_while_ingest_stores_a_batch_takes_the_batch_before_it_is_emitted(
        harness: Harness, monkeypatch) -> None:
    """The race: ingest read the tombstones (none), the erasure commits and lists alice's stored
    sessions (not this batch's new one, not committed yet), then the batch commits. Ingest reads the
    tombstones again once the batch is stored: the new session is tombstoned, its rows and alice's
    generations go, and no trajectory of it is emitted."""
    h, rng = harness, random.Random(11)
    sessions = make_session_factory(h.engine)
    start = datetime.now(UTC) - timedelta(seconds=30)
    new, bobs = session("n1", ALICE, start, 2, rng), session("b2", BOB, start, 1, rng)
    produce(h.settings, new.events + bobs.events)
    h.ingestor.tombstones.refresh_s = 3600  # its read is fresh: the batch would pass on it alone
    h.ingestor.tombstones.refresh(force=True)
    store_batch, asked = h.ingestor._apply, []

    def erased_meanwhile(events):  # the erasure commits between ingest's read and its commit
        if not asked:
            asked.append(erasure.request(sessions, Subject("acme", user_hash=ALICE), "dpo"))
        return store_batch(events)

    monkeypatch.setattr(h.ingestor, "_apply", erased_meanwhile)
    consumer = h.consumer("t-ingest", "generations", "feedback")
    h.ingest(consumer, h.drain(consumer, len(new.events) + len(bobs.events)))
    with sessions() as db:
        covered = set(db.scalars(select(ErasureSession.session_id).where(ErasureSession.erasure_id == asked[0])))
        stored = {kind: set(db.scalars(select(model.session_id)))
                  for kind, model in (("generation", Generation), ("feedback", Feedback), ("trajectory", Trajectory))}
    assert covered == {"n1"} and stored == {"generation": {"b2"}, "feedback": {"b2"}, "trajectory": {"b2"}}
    assert h.ingestor.counters["erased_after_store"] == 1
    on_bus = {TrajectoryEvent.from_bytes(r.value).session_id for r in read_topic(h.settings, h.settings.topic("trajectories"))}
    assert on_bus == {"b2"}


def test_a_session_tombstoned_while_open_is_never_closed(harness: Harness) -> None:
    h, rng = harness, random.Random(8)
    sessions = make_session_factory(h.engine)
    start = datetime.now(UTC) - timedelta(seconds=30)
    open_one = session("o1", ALICE, start, 2, rng)
    produce(h.settings, open_one.generations)  # turns stored, no outcome yet: the session is open
    consumer = h.consumer("t-ingest", "generations", "feedback")
    h.ingest(consumer, h.drain(consumer, 2))
    erasure.request(sessions, Subject("acme", user_hash=ALICE), "dpo")  # records o1 (stored) as tombstoned
    h.ingestor.tombstones.refresh(force=True)
    produce(h.settings, open_one.feedback)  # the outcome arrives after the tombstone
    h.ingest(consumer, h.drain(consumer, len(open_one.feedback)))
    h.ingestor.close_inactive()
    with sessions() as db:
        assert list(db.scalars(select(Trajectory.session_id))) == []
    assert read_topic(h.settings, h.settings.topic("trajectories"), timeout_s=1) == []


@pytest.mark.parametrize("known", ["before", "after_its_last_read"])
def test_the_rewards_stage_drops_an_erased_sessions_trajectories_without_a_dead_letter(
        harness: Harness, tmp_path, known: str) -> None:
    """Known to the stage before the batch, or erased after the stage's last read of the
    tombstones (it re-reads at most every second): the trajectory whose row the erasure deleted is
    dropped, not dead-lettered as one ingest never stored (the letter would keep it)."""
    h, rng = harness, random.Random(9)
    sessions = make_session_factory(h.engine)
    start = datetime.now(UTC) - timedelta(seconds=30)
    trajs = [assemble("acme", s.session_id, s.generations, s.feedback, closed_reason="outcome")
             for s in (session("x1", ALICE, start, 1, rng), session("y1", BOB, start, 1, rng))]
    tombstones = Tombstones(sessions, refresh_s=60)  # a slow clock: the batch comes before the next read
    if known == "after_its_last_read":
        tombstones.refresh()
    erasure.request(sessions, Subject("acme", session_id="x1"), "dpo")
    topic = h.settings.topic("trajectories")
    produce_raw = [("trajectories", t.session_id, t.to_bytes()) for t in trajs]
    produce(h.settings, [], raw=produce_raw)
    bus = make_bus(h.settings)
    consumer = bus.consumer("t-rewards", [topic])
    producer = bus.producer()
    scored_topic = h.settings.topic("scored")
    bus.ensure_topics([scored_topic])
    spec = load_spec()
    counters: Counter[str] = Counter()
    try:
        records = [r for _ in range(5) for r in consumer.poll(0.3, 100)]
        assert len(records) == 2
        process(records, consumer, sessions, producer, Scorer(spec), Normaliser(spec.normalise), scored_topic, counters,
                require_stored=True, tombstones=tombstones)
    finally:
        producer.close()
        consumer.close()
        bus.close()
    assert counters["erased"] == 1 and counters["dead_lettered"] == 1
    # y1 was never stored by ingest here: require_stored dead-letters it; x1 is dropped before that check
    letters = read_topic(h.settings, dlq_topic(topic), timeout_s=1)
    assert [r.key for r in letters] == ["y1"]


def test_the_trainer_buffer_lets_go_of_erased_samples_and_its_checkpoint_forgets_them() -> None:
    from tests.unit.test_loss import scored

    buf = SampleBuffer(max_staleness=4)
    samples: list[ScoredTrajectory] = [scored(name, [1]).model_copy(update={"session_id": name}) for name in "abc"]
    for s in samples:
        assert buf.add(s, None, current_version=1) is None
    gone = buf.purge_erased(lambda s: s.session_id == "b")
    assert [e.sample.session_id for e in gone] == ["b"] and buf.counters()["dropped_erased"] == 1
    restored = SampleBuffer(max_staleness=4)
    restored.load_state_dict(buf.state_dict())
    assert [e.sample.session_id for e in restored.take(2)] == ["a", "c"]


def test_the_second_pass_deletes_what_a_stage_stored_before_it_saw_the_tombstone(harness: Harness, monkeypatch) -> None:
    h, rng = harness, random.Random(10)
    sessions = make_session_factory(h.engine)
    start = datetime.now(UTC) - timedelta(seconds=30)
    consumer = ingested(h, "p1", start, rng)
    late = session("p2", ALICE, start + timedelta(seconds=5), 1, rng)  # sent before the request, ingested after it
    h.ingestor.tombstones = Tombstones(sessions, refresh_s=3600.0)  # a stage a refresh behind the erasure
    h.ingestor.tombstones.refresh()
    monkeypatch.setattr(h.ingestor, "_recheck", lambda stored: None)  # and not reading them after storing
    erasure_id = erasure.request(sessions, Subject("acme", user_hash=ALICE), "dpo")

    def settle(seconds: float) -> None:  # what the stage does during the erasure's settle time
        produce(h.settings, late.events)
        h.ingest(consumer, h.drain(consumer, len(late.events)))
        assert rows(sessions, Subject("acme", session_id="p2"))  # stored: the stage did not know yet

    monkeypatch.setattr(erasure.time, "sleep", settle)
    outcome = erasure.complete(sessions, erasure_id)
    assert rows(sessions, Subject("acme", user_hash=ALICE)) == {}
    assert rows(sessions, Subject("acme", session_id="p2")) == {}
    assert outcome.counts["generation"] == 2
    with sessions() as db:
        covered = set(db.scalars(select(ErasureSession.session_id).where(ErasureSession.erasure_id == erasure_id)))
    assert covered == {"p1", "p2"}
    assert erasure.sweep(sessions) == 0  # nothing left for the janitor


def test_the_janitors_sweep_deletes_what_a_stage_stored_late_and_keeps_the_users_new_sessions(
        harness: Harness, monkeypatch) -> None:
    h, rng = harness, random.Random(11)
    sessions = make_session_factory(h.engine)
    start = datetime.now(UTC) - timedelta(seconds=30)
    consumer = ingested(h, "q1", start, rng)
    h.ingestor.tombstones = Tombstones(sessions, refresh_s=3600.0)  # a stage that was down through the erasure
    h.ingestor.tombstones.refresh()
    monkeypatch.setattr(h.ingestor, "_recheck", lambda stored: None)  # and stored without seeing the tombstone
    erasure_id = erasure.request(sessions, Subject("acme", user_hash=ALICE), "dpo")
    erasure.complete(sessions, erasure_id, settle_s=0)
    assert erasure.sweep(sessions) == 0
    # back up, it stores what its spool shipped late: alice's turn from before the request, in q1 and in q2
    late = [generation("acme", "q1", "g-q1-late", [1, 2, 3], [4], start + timedelta(seconds=5), rng, user_hash=ALICE),
            *session("q2", ALICE, start + timedelta(seconds=6), 1, rng).events]
    new = session("q3", ALICE, datetime.now(UTC) + timedelta(seconds=1), 1, rng)  # after the request: hers to keep
    produce(h.settings, [*late, *new.events])
    h.ingest(consumer, h.drain(consumer, len(late) + len(new.events)))
    assert rows(sessions, Subject("acme", session_id="q1")) and rows(sessions, Subject("acme", session_id="q2"))
    assert erasure.sweep(sessions) > 0
    assert rows(sessions, Subject("acme", session_id="q1")) == {} == rows(sessions, Subject("acme", session_id="q2"))
    assert rows(sessions, Subject("acme", session_id="q3"))["generation"] == 1
    assert erasure.sweep(sessions) == 0


def test_scores_and_trained_rows_stored_after_the_trajectories_went_are_found_by_the_sweep(harness: Harness) -> None:
    h, rng = harness, random.Random(12)
    sessions = make_session_factory(h.engine)
    start = datetime.now(UTC) - timedelta(seconds=30)
    ingested(h, "r1", start, rng)
    erasure_id = erasure.request(sessions, Subject("acme", user_hash=ALICE), "dpo")
    erasure.complete(sessions, erasure_id, settle_s=0)
    # a rewards worker and a trainer a refresh behind store the session's score and training afterwards
    tid, now = trajectory_id_for("acme", "r1"), datetime.now(UTC)
    with sessions() as db, db.begin():
        db.add(ScoredTrajectoryRow(trajectory_id=tid, revision=0, reward_spec_version="v", event_id="late-score",
                                   tenant="acme", total_reward=1.0, ts=now, payload={}))
        db.add(TrainedTrajectory(trajectory_id=tid, model_line="line", version=9, trained_at=now))
    assert erasure.sweep(sessions) == 2
    with sessions() as db:
        assert db.scalar(select(func.count()).select_from(ScoredTrajectoryRow)) == 0
        assert db.scalar(select(func.count()).select_from(TrainedTrajectory)) == 0
        assert {"model_line": "line", "version": 9} in db.get(Erasure, erasure_id).trained_into
