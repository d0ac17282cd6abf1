"""The ingest worker: generations + feedback from the bus -> persisted raw events -> trajectories.

Per polled batch, in one database transaction: decode each record (undecodable or invalid ->
dead letter, still committed; a large event the gateway split into chunks is reassembled first by
``flywheel.bus.envelope``, and offsets are committed only up to the first chunk of a set still
incomplete, so a restart reads its chunks again), persist the raw events idempotently, track the
sessions, and close those an outcome (or abandonment) ended, or that late feedback re-opened.
Then the DB commit, then the trajectories go on the bus, and only then the bus offsets are
committed. Sessions with no event for ``ingest.inactivity_timeout_s`` are closed on every pass
once the consumer has caught up (a full poll means a backlog: its old timestamps must not close
sessions whose next event is still queued).

Crash safety (the outbox): closing a session commits its trajectory row and sets the session to
``closing`` in the same transaction; a trajectory is produced only from that committed state, and
the session becomes ``closed`` only after the producer's flush returned. Every pass starts by
producing what is still ``closing``, so a crash anywhere after the commit re-emits on restart.
A crash after the flush but before ``closed`` re-emits the same bytes with the same ``event_id``,
which every consumer treats as a duplicate. Offsets are committed after all of that, so a crash
before it replays the batch, and the replay is a no-op (raw events are keyed by ``event_id``;
only newly stored events change a session).

Late feedback: feedback for a closed session within ``ingest.late_horizon_s`` of its close (by
the feedback's timestamp) re-opens it: ``revision + 1``, closed reason ``late_feedback``. Later
feedback is stored with state ``expired`` and counted, nothing re-emitted. A new generation in a
closed session re-opens it; its next close is the next revision.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from sqlalchemy.orm import Session, sessionmaker

from flywheel.bus import Consumer, Producer, Record, make_bus
from flywheel.bus.envelope import Reassembler
from flywheel.db.session import make_session_factory, open_database
from flywheel.events import FeedbackEvent, GenerationEvent
from flywheel.settings import Settings
from ingest import store
from ingest.assemble import ClosedReason, assemble

log = logging.getLogger("flywheel.ingest")

POLL_TIMEOUT_S = 0.5
MAX_RECORDS = 500


def is_session_outcome(event: FeedbackEvent) -> bool:
    """Feedback that ends a session: an outcome, or the user abandoning it."""
    return event.kind == "outcome" or event.signal == "abandon"


class Ingestor:
    """The worker's state between passes: database, producer, topic names and counters."""

    def __init__(self, settings: Settings, sessions: sessionmaker[Session], producer: Producer) -> None:
        self.settings = settings
        self.sessions = sessions
        self.producer = producer
        self.generations_topic = settings.topic("generations")
        self.feedback_topic = settings.topic("feedback")
        self.trajectories_topic = settings.topic("trajectories")
        self.counters: Counter[str] = Counter()
        self.reassembler = Reassembler()

    # --- one polled batch ------------------------------------------------------------------------

    def process(self, records: Sequence[Record], consumer: Consumer) -> None:
        """Persist ``records`` and close what they ended; committed and emitted when this returns."""
        now = datetime.now(UTC)
        horizon = timedelta(seconds=self.settings.ingest.late_horizon_s)
        to_close: dict[tuple[str, str], ClosedReason] = {}
        with self.sessions() as db, db.begin():
            for record in records:
                event = self._decode(record, consumer)
                if isinstance(event, GenerationEvent):
                    self._on_generation(db, event)
                elif isinstance(event, FeedbackEvent):
                    reason = self._on_feedback(db, event, horizon)
                    if reason is not None and to_close.get((event.tenant, event.session_id)) != "late_feedback":
                        to_close[(event.tenant, event.session_id)] = reason
            for (tenant, session_id), reason in to_close.items():
                self._close(db, tenant, session_id, reason, now)
        self.emit_pending()

    def committable(self, records: Sequence[Record], consumer: Consumer) -> list[Record]:
        """The polled ``records`` whose offsets may be committed (see the module docstring)."""
        self.reassembler.retain(consumer.assignment())
        return self.reassembler.committable(records)

    def _decode(self, record: Record, consumer: Consumer) -> GenerationEvent | FeedbackEvent | None:
        kind = GenerationEvent if record.topic == self.generations_topic else FeedbackEvent
        try:
            whole = self.reassembler.feed(record)
            if whole is None:
                return None  # a chunk of a large event; the event comes with its last chunk
            return kind.from_bytes(whole.value)
        except ValueError as exc:  # EnvelopeError, pydantic.ValidationError, UnicodeDecodeError
            reason = f"undecodable {kind.__name__}: {exc}"[:1000]
            consumer.dead_letter(record, reason)
            self.counters["dead_lettered"] += 1
            log.warning("dead-lettered %s[%d]@%d: %s", record.topic, record.partition, record.offset, reason[:200])
            return None

    def _on_generation(self, db: Session, event: GenerationEvent) -> None:
        if not store.insert_generation(db, event):
            self.counters["duplicate_generations"] += 1
            return
        self.counters["generations"] += 1
        state = store.touch_session(db, event.tenant, event.session_id, event.ts)
        if state.status in (store.CLOSED, store.EMPTY):
            store.set_status(db, event.tenant, event.session_id, expect=(state.status,), status=store.OPEN)
            self.counters["sessions_reopened"] += 1

    def _on_feedback(self, db: Session, event: FeedbackEvent, horizon: timedelta) -> ClosedReason | None:
        """Store one feedback event; returns why its session must close now, if it must."""
        state = store.get_session(db, event.tenant, event.session_id)
        closed = state is not None and state.status in (store.CLOSED, store.CLOSING)
        if closed and state is not None and state.closed_at is not None and event.ts - state.closed_at > horizon:
            if store.insert_feedback(db, event, state="expired"):
                self.counters["feedback_expired"] += 1
            else:
                self.counters["duplicate_feedback"] += 1
            return None
        if not store.insert_feedback(db, event, state="pending"):
            self.counters["duplicate_feedback"] += 1
            return None
        self.counters["feedback"] += 1
        store.touch_session(db, event.tenant, event.session_id, event.ts)
        if closed:
            self.counters["feedback_late"] += 1
            return "late_feedback"
        return "outcome" if is_session_outcome(event) else None

    def _close(self, db: Session, tenant: str, session_id: str, reason: ClosedReason, now: datetime) -> None:
        """Assemble and store the session's trajectory and move it to ``closing`` (uncommitted)."""
        state = store.get_session(db, tenant, session_id)
        if state is None:
            return
        if reason != "late_feedback" and state.status != store.OPEN:
            return  # already closed (or being closed) by an earlier pass or another worker
        generations, feedback = store.session_events(db, tenant, session_id)
        if not generations:
            # Feedback before any generation: nothing to train on yet; a generation re-opens it.
            store.set_status(db, tenant, session_id, expect=(store.OPEN,), status=store.EMPTY)
            self.counters["sessions_empty"] += 1
            return
        revision = state.revision + 1 if state.closed_at is not None else 0
        if not store.claim_close(db, state, revision, now):
            return
        traj = assemble(tenant, session_id, generations, feedback, closed_reason=reason, revision=revision)
        store.insert_trajectory(db, traj)
        store.mark_feedback_joined(db, tenant, session_id)
        self.counters[f"closed_{reason}"] += 1
        log.debug(
            "closed session %s/%s (%s): revision %d, %d turns, %d feedback",
            tenant, session_id, reason, revision, len(traj.generation_ids), len(traj.feedback),
        )

    # --- passes independent of the batch ---------------------------------------------------------

    def close_inactive(self) -> int:
        now = datetime.now(UTC)
        cutoff = now - timedelta(seconds=self.settings.ingest.inactivity_timeout_s)
        with self.sessions() as db, db.begin():
            stale = store.inactive_sessions(db, cutoff, limit=MAX_RECORDS)
            for tenant, session_id in stale:
                self._close(db, tenant, session_id, "inactivity", now)
        if stale:
            self.emit_pending()
        return len(stale)

    def emit_pending(self) -> int:
        """Produce every ``closing`` trajectory, flush, then mark those sessions ``closed``."""
        with self.sessions() as db:
            pending = store.pending_emissions(db, limit=MAX_RECORDS)
        if not pending:
            return 0
        for traj in pending:
            self.producer.send(self.trajectories_topic, traj.session_id, traj.to_bytes())
        self.producer.flush()
        with self.sessions() as db, db.begin():
            for traj in pending:
                store.set_status(
                    db, traj.tenant, traj.session_id, expect=(store.CLOSING,), status=store.CLOSED,
                    revision=traj.revision,
                )
        self.counters["trajectories_emitted"] += len(pending)
        return len(pending)


def run(settings: Settings, stop: threading.Event | None = None) -> None:
    """Consume generations and feedback until ``stop`` is set (see the module docstring)."""
    stop = stop or threading.Event()
    engine = open_database(settings.database_url, settings.db.wait_s)
    bus = make_bus(settings)
    topics = [settings.topic("generations"), settings.topic("feedback")]
    bus.ensure_topics([*topics, settings.topic("trajectories")])
    consumer = bus.consumer("ingest", topics)
    producer = bus.producer()
    ingestor = Ingestor(settings, make_session_factory(engine), producer)
    log.info("ingest consuming %s", ", ".join(topics))
    try:
        while not stop.is_set():
            ingestor.emit_pending()
            records = consumer.poll(timeout_s=POLL_TIMEOUT_S, max_records=MAX_RECORDS)
            if records:
                ingestor.process(records, consumer)
                consumer.commit(ingestor.committable(records, consumer))
            if len(records) < MAX_RECORDS:
                ingestor.close_inactive()
    finally:
        log.info("ingest stopping: %s", dict(ingestor.counters))
        consumer.close()
        producer.close()
        bus.close()
        engine.dispose()
