"""The rewards worker: trajectories from the bus -> scored (persisted, then produced).

Per polled batch: decode (undecodable -> dead letter), score with the configured spec (a pure
builder), insert the scores idempotently, commit the database, produce every ScoredTrajectory and
flush, and only then commit the offsets. A scored event's ``event_id`` is derived from
``(trajectory_id, revision, spec_version)``, so a crash anywhere replays the batch into the same
rows (no-ops) and the same events (duplicates every consumer drops): at-least-once on the bus,
exactly-once in the database.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections import Counter
from collections.abc import Sequence

from sqlalchemy.orm import Session, sessionmaker

from flywheel.bus import Consumer, Producer, Record, make_bus
from flywheel.db.models import ScoredTrajectoryRow
from flywheel.db.session import insert_ignore, make_session_factory, open_database
from flywheel.events import ScoredTrajectory, TrajectoryEvent
from flywheel.settings import RewardSettings, Settings
from rewards.builders import explicit_outcome_reward

log = logging.getLogger("flywheel.rewards")

POLL_TIMEOUT_S = 0.5
MAX_RECORDS = 200


def scored_event_id(trajectory_id: str, revision: int, spec_version: str) -> str:
    return uuid.uuid5(uuid.NAMESPACE_URL, f"flywheel-scored:{trajectory_id}:{revision}:{spec_version}").hex


def score(traj: TrajectoryEvent, spec: RewardSettings) -> ScoredTrajectory:
    """The scored form of ``traj`` under ``spec`` (deterministic, like the builder)."""
    out = explicit_outcome_reward(traj, spec)
    return ScoredTrajectory(
        event_id=scored_event_id(traj.trajectory_id, traj.revision, spec.spec_version),
        ts=traj.ts,
        tenant=traj.tenant,
        session_id=traj.session_id,
        trajectory_id=traj.trajectory_id,
        revision=traj.revision,
        model_line=traj.model_line,
        segments=traj.segments,
        turn_rewards=out.turn_rewards,
        total_reward=out.total,
        reward_components=out.components,
        reward_spec_version=spec.spec_version,
        prompt_key=traj.prompt_key,
    )


def process(
    records: Sequence[Record],
    consumer: Consumer,
    sessions: sessionmaker[Session],
    producer: Producer,
    settings: Settings,
    counters: Counter[str],
) -> None:
    """Score, persist and produce one batch; the caller commits the offsets afterwards."""
    scored: list[ScoredTrajectory] = []
    for record in records:
        try:
            traj = TrajectoryEvent.from_bytes(record.value)
        except ValueError as exc:
            reason = f"undecodable TrajectoryEvent: {exc}"[:1000]
            consumer.dead_letter(record, reason)
            counters["dead_lettered"] += 1
            log.warning("dead-lettered %s[%d]@%d: %s", record.topic, record.partition, record.offset, reason[:200])
            continue
        scored.append(score(traj, settings.rewards))
    if not scored:
        return
    rows = [
        {
            "trajectory_id": s.trajectory_id,
            "revision": s.revision,
            "reward_spec_version": s.reward_spec_version,
            "event_id": s.event_id,
            "tenant": s.tenant,
            "total_reward": s.total_reward,
            "ts": s.ts,
            "payload": s.model_dump(mode="json"),
        }
        for s in scored
    ]
    with sessions() as db, db.begin():
        new = insert_ignore(db, ScoredTrajectoryRow, rows)
    counters["scored"] += new
    counters["duplicates"] += len(rows) - new
    topic = settings.topic("scored")
    for s in scored:  # re-produced even when not new: the previous attempt may have died before its flush
        producer.send(topic, s.session_id, s.to_bytes())
    producer.flush()


def run(settings: Settings, stop: threading.Event | None = None) -> None:
    """Score trajectories until ``stop`` is set (see the module docstring)."""
    stop = stop or threading.Event()
    engine = open_database(settings.database_url, settings.db.wait_s)
    sessions = make_session_factory(engine)
    bus = make_bus(settings)
    source = settings.topic("trajectories")
    bus.ensure_topics([source, settings.topic("scored")])
    consumer = bus.consumer("rewards", [source])
    producer = bus.producer()
    counters: Counter[str] = Counter()
    log.info("rewards scoring %s with spec %s", source, settings.rewards.spec_version)
    try:
        while not stop.is_set():
            records = consumer.poll(timeout_s=POLL_TIMEOUT_S, max_records=MAX_RECORDS)
            if records:
                process(records, consumer, sessions, producer, settings, counters)
                consumer.commit(records)
    finally:
        log.info("rewards stopping: %s", dict(counters))
        consumer.close()
        producer.close()
        bus.close()
        engine.dispose()
