"""The ingest worker: generations + feedback from the bus -> persisted raw events -> trajectories.

Per polled batch, in one database transaction: decode and check each record (undecodable or
invalid -> dead letter with the reason, still committed; a large event the gateway split into
chunks is reassembled first by ``flywheel.bus.envelope``, and offsets are committed only up to
the first chunk of a set still incomplete, so a restart reads its chunks again), lock the batch's
sessions, persist the raw events idempotently, update the sessions, and close those an outcome
(or abandonment) ended or that late feedback re-opened. Then the DB commit, then the trajectories
go on the bus, and only then the bus offsets are committed.

Invalid events never block their neighbours: an event the database would refuse (a string longer
than its column, a 32-bit overflow) or that no trajectory can carry (sampling outside what a
``Turn`` allows) is dead-lettered before the batch is written; should the database still refuse
a batch (``DataError``/``IntegrityError``), or applying it fail on its data
(``flywheel.bus.base.BAD_RECORD``: a value no code path expected), it is written again one event
per transaction and only the events that still fail are dead-lettered. Decoding applies the
system's JSON policy (``flywheel.jsonpolicy``), so nothing stored is a poison pill when read back.

Several workers in one consumer group (processes, any number, partitions moving between them):

- A session changes only while its ``sessions`` row is locked (``ingest.store``). Its generations
  and its feedback are on different topics, so two workers may read them at once, and after a
  rebalance a new owner may read records the old one is still writing: whoever locks the session
  second sees all the first committed. (Without the lock an outcome closing a session in one
  worker missed a generation another worker was inserting: a turn lost from every revision.)
- The outbox is claimed, not shared: a worker emits only ``closing`` sessions it has locked
  (``SKIP LOCKED``), so two workers never put the same revision on the bus.
- A session that leaves ``closing`` before its trajectory was emitted (a new generation, or late
  feedback closing the next revision) puts that revision on the bus first, flushed before the
  commit: no revision is ever skipped.
- The inactivity sweep closes only sessions whose generations partition (Kafka's partitioner over
  ``bus.partitions``, the count flywheel creates its topics with) this worker owns, and only when
  its last poll was not full and its assignment did not just change: a session whose newer events
  still wait on another worker's backlog is not closed early. A session still open
  ``ingest.orphan_timeout_s`` (default 10 x the inactivity timeout) after its last event is
  closed by any worker (its partition has no live owner, or its topic has another partition count).

Crash safety (the outbox): closing a session commits its trajectory row and sets the session to
``closing`` in the same transaction; a trajectory is produced only from that committed state, and
the session becomes ``closed`` only after the producer's flush returned. Every pass starts by
producing what is still ``closing``, so a crash anywhere after the commit re-emits on restart.
A crash after the flush but before ``closed`` re-emits the same bytes with the same ``event_id``,
which every consumer treats as a duplicate. Offsets are committed after all of that, so a crash
before it replays the batch, and the replay is a no-op (raw events are keyed by ``event_id``;
only newly stored events change a session). Replaying the topics from the start, in a new group,
changes nothing in the database for the same reason.

A database outage (``flywheel.db.session.is_db_outage``: the database refused or dropped the
connection) does not end the process: the turn that met it is abandoned, the ``Ingestor`` is
dropped (its reassembly buffers, watermarks, deferred outcomes and event cache are what a crash
loses), and the worker waits for the database (up to ``db.wait_s`` per outage, beating its health
file and polling the bus now and then so that it stays in its consumer group, dropping what that
returns). Then it rewinds its partitions to their committed offsets and starts over with a new
``Ingestor``: what the crash-safety rules above make of a restart, without leaving the group (no
rebalance; on some brokers a member that leaves mid-join wedges the group). An outage longer than
``db.wait_s``, and any other error, still ends the process.

Outcomes wait for their turns: the feedback topic can run ahead of the generations topic (a
backlog, a slow partition), and closing on an outcome then would emit a truncated revision scored
with the whole session's outcome. A session whose generations partition this worker owns closes on
its outcome only once that partition's watermark (the newest generation time read from it) reached
the outcome's time, or nothing is left to read there; until then it stays open and is checked
after every pass (after a crash, the inactivity sweep closes it).

Out of order: feedback may come before its generation. An outcome for a session without
generations leaves it ``empty``; a generation that arrives at a session which already has an
outcome (or abandonment) at or after its own timestamp closes it again at once (reason
``outcome``), so late turns reach a trajectory without waiting for the inactivity timeout.

Erased subjects (flywheel/tombstones.py): a record of a tombstoned session, or a generation of a
tombstoned user sent before the erasure was requested, is dropped before anything is stored (counted
``erased``); such a generation tombstones its session for every stage, and what ingest stored of
that session before (its feedback, read first) is deleted with it. A session tombstoned while
open is never closed into a trajectory (it becomes ``empty``, and its cached events are forgotten).
The tombstones this worker holds may be up to ``tombstones.REFRESH_S`` old, and an erasure's own
passes list the user's sessions when they run: so once a batch is stored the worker reads them
again (:meth:`_recheck`) and an erasure that committed meanwhile takes what the batch stored of
its user, the new sessions included, before any of it is emitted.

Late feedback: feedback for a closed session within ``ingest.late_horizon_s`` of its close (in
event time: the feedback's ``ts`` after the newest event of the closed trajectory) re-opens it:
``revision + 1``, closed reason ``late_feedback``. Later feedback is stored with state
``expired`` and counted, nothing re-emitted. A new generation in a closed session re-opens it;
its next close is the next revision.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from datetime import UTC, datetime, timedelta

from sqlalchemy.exc import DataError, IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from flywheel import erasure
from flywheel.bus import Consumer, Producer, Record, make_bus, partition_for_key
from flywheel.bus.base import route_to_dlq, stay_in_group
from flywheel.bus.envelope import Reassembler
from flywheel.db.models import Feedback, Generation
from flywheel.db.session import BAD_ROW, OutageWait, make_session_factory, open_database
from flywheel.events import FeedbackEvent, GenerationEvent, TrajectoryEvent
from flywheel.health import Beat
from flywheel.settings import Settings
from flywheel.tombstones import Tombstones
from ingest import store
from ingest.assemble import ClosedReason, assemble, turn_of

log = logging.getLogger("flywheel.ingest")

POLL_TIMEOUT_S = 0.5
MAX_RECORDS = 500
_TICK = timedelta(microseconds=1)

Event = GenerationEvent | FeedbackEvent


def is_session_outcome(event: FeedbackEvent) -> bool:
    """Feedback that ends a session: an outcome, or the user abandoning it."""
    return event.kind == "outcome" or event.signal == "abandon"


def check_event(event: Event) -> None:
    """Raise ``ValueError`` if ``event`` decodes but cannot be stored or trained on (see the docstring)."""
    if isinstance(event, GenerationEvent):
        store.check_fits(Generation, store.generation_columns(event))
        turn_of(event, 0, len(event.completion_token_ids))
    else:
        store.check_fits(Feedback, store.feedback_columns(event))


class Ingestor:
    """The worker's state between passes: database, producer, topic names and counters (``counters``:
    shared with the worker, which keeps them across the ``Ingestor`` it replaces after an outage)."""

    def __init__(self, settings: Settings, sessions: sessionmaker[Session], producer: Producer,
                 counters: Counter[str] | None = None) -> None:
        self.settings = settings
        self.sessions = sessions
        self.producer = producer
        self.generations_topic = settings.topic("generations")
        self.feedback_topic = settings.topic("feedback")
        self.trajectories_topic = settings.topic("trajectories")
        self.counters: Counter[str] = Counter() if counters is None else counters
        self.reassembler = Reassembler()
        self.cache = store.EventCache(settings.ingest.cache_tokens)
        #: Per generations partition, the newest event time read from it (the watermark).
        self.watermarks: dict[int, datetime] = {}
        #: Sessions an outcome ended while turns of theirs may still wait on the bus -> outcome time.
        self.deferred: dict[store.Key, datetime] = {}
        self.consumer: Consumer | None = None
        self.tombstones = Tombstones(sessions)
        #: The JSON of the trajectories closed in this pass (stored and produced from one encoding).
        self._encoded: dict[str, tuple[TrajectoryEvent, bytes]] = {}

    # --- one polled batch ------------------------------------------------------------------------

    def process(self, records: Sequence[Record], consumer: Consumer) -> None:
        """Persist ``records`` and close what they ended; committed and emitted when this returns."""
        self.consumer = consumer
        decoded = [(record, event) for record in records if (event := self._decode(record, consumer)) is not None]
        for record, event in decoded:
            if isinstance(event, GenerationEvent) and event.ts > self.watermarks.get(record.partition, event.ts - _TICK):
                self.watermarks[record.partition] = event.ts
        decoded = self._drop_erased(decoded)
        if decoded:
            try:
                closed = self._apply([event for _, event in decoded])
                self._recheck(decoded)
                self._emit(closed)
            except BAD_ROW as exc:
                log.warning("a batch of %d events could not be stored (%s); writing them one by one",
                            len(decoded), _why(exc)[:200])
                self.counters["batches_split"] += 1
                for record, event in decoded:
                    try:
                        closed = self._apply([event])
                        self._recheck([(record, event)])
                        self._emit(closed)
                    except BAD_ROW as one:
                        self._dead_letter(record, consumer, f"refused by the database: {_why(one)}"
                                          if isinstance(one, (DataError, IntegrityError))
                                          else f"cannot be applied: {type(one).__name__}: {one}")
        self.emit_pending()

    def committable(self, records: Sequence[Record], consumer: Consumer) -> list[Record]:
        """The polled ``records`` whose offsets may be committed (see the module docstring)."""
        self.reassembler.retain(consumer.assignment())
        return self.reassembler.committable(records)

    def _decode(self, record: Record, consumer: Consumer) -> Event | None:
        kind = GenerationEvent if record.topic == self.generations_topic else FeedbackEvent
        try:
            whole = self.reassembler.feed(record)
            if whole is None:
                return None  # a chunk of a large event; the event comes with its last chunk
            event = kind.from_bytes(whole.value)
        except ValueError as exc:  # EnvelopeError, pydantic.ValidationError, UnicodeDecodeError
            self._dead_letter(record, consumer, f"undecodable {kind.__name__}: {exc}")
            return None
        try:
            check_event(event)
        except ValueError as exc:
            self._dead_letter(record, consumer, f"invalid {kind.__name__}: {exc}")
            return None
        return event

    def _drop_erased(self, decoded: list[tuple[Record, Event]]) -> list[tuple[Record, Event]]:
        """``decoded`` without the records of erased subjects (module docstring); the sessions an
        erased user's generations name are tombstoned first, so their other events go too."""
        self._refresh_tombstones()
        self._take_erased([event for _, event in decoded], stored=False)
        drops = self.tombstones.drops_session
        kept = [(record, event) for record, event in decoded if not drops(event.tenant, event.session_id)]
        self.counters["erased"] += len(decoded) - len(kept)
        return kept

    def _recheck(self, stored: list[tuple[Record, Event]]) -> None:
        """After ``stored`` committed: tombstones new since :meth:`_drop_erased` read them cover
        the erased users' generations just stored (module docstring): their sessions are tombstoned
        and what is stored of them goes, the user's generations too (``_produce`` then emits none)."""
        if self._refresh_tombstones(force=True):
            self.counters["erased_after_store"] += self._take_erased([event for _, event in stored], stored=True)

    def _refresh_tombstones(self, force: bool = False) -> bool:
        """Read the tombstones when due (or ``force``); cached events of newly tombstoned sessions go."""
        tombstones = self.tombstones
        if not tombstones.refresh(force=force):
            return False
        self.cache.purge(lambda event: tombstones.drops_session(event.tenant, event.session_id))
        return True

    def _take_erased(self, events: list[Event], *, stored: bool) -> int:
        """Tombstone, for every stage, the sessions of ``events``' generations an erasure covers,
        and delete what this stage stored of them; with ``stored`` (the events themselves are
        stored already) the erased user's generations go too, and sessions already tombstoned
        are taken as well (an erasure's own pass may have run before they were stored). Returns
        the sessions taken."""
        tombstones = self.tombstones
        found: dict[tuple[int, str, str | None], set[str]] = {}  # (erasure, tenant, user hash) -> sessions
        for event in events:
            if isinstance(event, GenerationEvent) and (stored or not tombstones.drops_session(event.tenant, event.session_id)):
                erasure_id = tombstones.erasure_of(event.tenant, event.user_hash, event.ts)
                if erasure_id is not None:
                    found.setdefault((erasure_id, event.tenant, event.user_hash), set()).add(event.session_id)
        if found:
            with self.sessions() as db, db.begin():
                for (erasure_id, tenant, user_hash), session_ids in found.items():
                    tombstones.cover(db, erasure_id, {(tenant, s) for s in session_ids})
                    erasure.erase_found(db, erasure_id, tenant, session_ids, user_hash=user_hash if stored else None)
        return sum(len(s) for s in found.values())

    def _dead_letter(self, record: Record, consumer: Consumer, reason: str) -> None:
        route_to_dlq(consumer, record, reason, self.counters, log)

    def _apply(self, events: Sequence[Event]) -> list[TrajectoryEvent]:
        """One transaction: lock the sessions, store the new events, apply them in order, close.
        Returns the trajectories it closed (committed, in the outbox)."""
        horizon = timedelta(seconds=self.settings.ingest.late_horizon_s)
        first_seen: dict[store.Key, datetime] = {}
        for event in events:
            key = (event.tenant, event.session_id)
            first_seen[key] = min(first_seen.get(key, event.ts), event.ts)
        with self.sessions() as db, db.begin():
            states = store.lock_sessions(db, first_seen)
            fresh = store.insert_generations(db, _first_of_each(
                [e for e in events if isinstance(e, GenerationEvent)], lambda e: [e.event_id, e.generation_id]))
            outbox: list[tuple[str, str, int]] = []  # closing revisions to put on the bus before this commit
            reopened: dict[store.Key, datetime] = {}
            feedback: list[tuple[FeedbackEvent, str, bool]] = []  # (event, state, its session was closed)
            seen: set[str] = set()
            for event in events:
                key = (event.tenant, event.session_id)
                state = states[key]
                if isinstance(event, GenerationEvent):
                    if event.event_id not in fresh:
                        self.counters["duplicate_generations"] += 1
                        continue
                    fresh.discard(event.event_id)
                    self.cache.put(event)
                    self.counters["generations"] += 1
                    _advance(state, event.ts)
                    if state.status != store.OPEN:
                        _leave_closing(state, outbox)
                        state.status = store.OPEN
                        reopened[key] = min(reopened.get(key, event.ts), event.ts)
                        self.counters["sessions_reopened"] += 1
                elif seen.isdisjoint((event.event_id, f"{event.tenant}\0{event.feedback_id}")):
                    seen.update((event.event_id, f"{event.tenant}\0{event.feedback_id}"))
                    closed = state.status in (store.CLOSED, store.CLOSING)
                    expired = closed and state.closed_at is not None and event.ts - state.closed_at > horizon
                    feedback.append((event, "expired" if expired else "pending", closed))
                else:
                    self.counters["duplicate_feedback"] += 1
            stored = store.insert_feedback(db, [(event, fb_state) for event, fb_state, _ in feedback])
            to_close: dict[store.Key, ClosedReason] = {}
            outcomes: dict[store.Key, datetime] = {}  # sessions an outcome ended, at its event time
            for event, fb_state, closed in feedback:
                key = (event.tenant, event.session_id)
                if event.event_id not in stored:
                    self.counters["duplicate_feedback"] += 1
                elif fb_state == "expired":
                    self.counters["feedback_expired"] += 1
                else:
                    self.counters["feedback"] += 1
                    _advance(states[key], event.ts)
                    if closed:
                        self.counters["feedback_late"] += 1
                        to_close[key] = "late_feedback"
                    elif is_session_outcome(event):
                        outcomes[key] = max(outcomes.get(key, event.ts), event.ts)
            ended = store.latest_outcomes(db, [key for key in reopened if key not in to_close])
            for key, outcome_at in ended.items():
                if outcome_at >= reopened[key]:  # a turn served before the outcome that ended its session
                    outcomes[key] = max(outcomes.get(key, outcome_at), outcome_at)
            for key, outcome_at in outcomes.items():
                if key in to_close:
                    continue
                if self._turns_all_read(key, outcome_at):
                    to_close[key] = "outcome"
                    self.deferred.pop(key, None)
                else:
                    self.deferred[key] = max(self.deferred.get(key, outcome_at), outcome_at)
                    self.counters["outcomes_deferred"] += 1
            closed = self._close(db, states, to_close, outbox)
            store.save_sessions(db, states.values())
            if outbox:  # inside the transaction: once it commits, nothing else would emit them
                self._produce(store.trajectories_at(db, outbox))
        return closed

    def _close(
        self, db: Session, states: dict[store.Key, store.State], to_close: dict[store.Key, ClosedReason],
        outbox: list[tuple[str, str, int]],
    ) -> list[TrajectoryEvent]:
        """Assemble and store the trajectories of locked sessions; move them to ``closing`` (uncommitted)."""
        if not to_close:
            return []
        events = store.session_events(db, list(to_close), self.cache)
        closed: list[TrajectoryEvent] = []
        for key, reason in sorted(to_close.items()):
            state = states[key]
            generations, feedback = events[key]
            if self.tombstones.drops_session(*key):  # erased while open: nothing of it goes on
                state.status = store.EMPTY
                self.counters["sessions_erased"] += 1
                continue
            if not generations:
                # Feedback before any generation: nothing to train on yet; a generation re-opens it.
                state.status = store.EMPTY
                self.counters["sessions_empty"] += 1
                continue
            _leave_closing(state, outbox)
            revision = state.revision + 1 if state.closed_at is not None else 0
            traj = assemble(key[0], key[1], generations, feedback, closed_reason=reason, revision=revision)
            state.status, state.revision, state.closed_at = store.CLOSING, revision, traj.ts
            closed.append(traj)
            self.counters[f"closed_{reason}"] += 1
            log.debug("closed session %s/%s (%s): revision %d, %d turns, %d feedback",
                      key[0], key[1], reason, revision, len(traj.generation_ids), len(traj.feedback))
        encoded = [(traj, traj.to_bytes().decode()) for traj in closed]
        self._encoded = {traj.event_id: (traj, text.encode()) for traj, text in encoded}
        store.insert_trajectories(db, encoded)
        store.mark_feedback_joined(db, [(t.tenant, t.session_id) for t in closed])
        return closed

    def _turns_all_read(self, key: store.Key, outcome_at: datetime) -> bool:
        """Whether every turn served before ``outcome_at`` in session ``key`` has been read off the
        bus: true when this worker does not own the session's generations partition (it cannot
        tell; its owner stores them, and a turn stored after the close re-closes the session), when
        that partition's watermark reached ``outcome_at``, or when it has no record left to read.
        With a backlog the feedback topic can run ahead of the generations topic; closing on the
        outcome then would emit a truncated revision scored with the whole session's outcome."""
        consumer = self.consumer
        partition = partition_for_key(key[1], self.settings.bus.partitions)
        if consumer is None or (self.generations_topic, partition) not in consumer.assignment():
            return True
        mark = self.watermarks.get(partition)
        return (mark is not None and mark >= outcome_at) or consumer.caught_up(self.generations_topic, partition)

    def close_deferred(self) -> int:
        """Close the sessions an outcome ended once their turns are all read (``_turns_all_read``)."""
        ready = {key: at for key, at in self.deferred.items() if self._turns_all_read(key, at)}
        if not ready:
            return 0
        for key in ready:
            del self.deferred[key]
        with self.sessions() as db, db.begin():
            states = {key: state for key, state in store.lock_sessions(db, ready).items() if state.status == store.OPEN}
            closed = self._close(db, states, dict.fromkeys(states, "outcome"), [])
            store.save_sessions(db, states.values())
        self._emit(closed)
        return len(closed)

    # --- passes independent of the batch ---------------------------------------------------------

    def close_inactive(self, owned: Collection[int] | None = None) -> int:
        """Close sessions idle for ``ingest.inactivity_timeout_s`` on the generations partitions in
        ``owned`` (None: every partition), and any idle past the orphan timeout."""
        now = datetime.now(UTC)
        cutoff = now - timedelta(seconds=self.settings.ingest.inactivity_timeout_s)
        orphaned = now - timedelta(seconds=self.settings.ingest.orphan_after_s)
        partitions = self.settings.bus.partitions
        with self.sessions() as db, db.begin():
            candidates = store.inactive_sessions(db, cutoff, limit=MAX_RECORDS)
            mine = [(tenant, session_id) for tenant, session_id, last in candidates
                    if owned is None or last < orphaned or partition_for_key(session_id, partitions) in owned]
            states = store.lock_inactive(db, mine, cutoff)
            closed = self._close(db, states, dict.fromkeys(states, "inactivity"), [])
            store.save_sessions(db, states.values())
        self._emit(closed)
        return len(states)

    def emit_pending(self) -> int:
        """Claim ``closing`` sessions, produce their trajectories, flush, then mark them ``closed``."""
        with self.sessions() as db, db.begin():
            claimed = store.claim_pending(db, limit=MAX_RECORDS)
            if not claimed:
                return 0
            self._produce(store.trajectories_at(db, [(s.tenant, s.session_id, s.revision) for s in claimed]))
            store.mark_closed(db, claimed)
        return len(claimed)

    def _emit(self, closed: Sequence[TrajectoryEvent]) -> None:
        """``emit_pending`` for trajectories this worker just committed, produced from memory."""
        if not closed:
            return
        with self.sessions() as db, db.begin():
            claimed = store.claim_pending(db, only=[(t.tenant, t.session_id, t.revision) for t in closed])
            mine = {(s.tenant, s.session_id, s.revision) for s in claimed}
            self._produce([t for t in closed if (t.tenant, t.session_id, t.revision) in mine])
            store.mark_closed(db, claimed)

    def _produce(self, trajectories: Sequence[TrajectoryEvent]) -> None:
        kept = [t for t in trajectories if not self.tombstones.drops_session(t.tenant, t.session_id)]
        # a trajectory committed before its session was tombstoned: the erasure deletes the row
        self.counters["erased"] += len(trajectories) - len(kept)
        trajectories = kept
        if not trajectories:
            return
        for traj in trajectories:
            same, value = self._encoded.get(traj.event_id, (None, b""))
            self.producer.send(self.trajectories_topic, traj.session_id, value if same is traj else traj.to_bytes())
        self.producer.flush()
        self.counters["trajectories_emitted"] += len(trajectories)


def _why(exc: Exception) -> str:
    orig = getattr(exc, "orig", None)
    return str(orig or exc).strip()


def _advance(state: store.State, ts: datetime) -> None:
    if ts > state.last_event_at:
        state.last_event_at = ts


def _leave_closing(state: store.State, outbox: list[tuple[str, str, int]]) -> None:
    """A session about to leave ``closing``: its committed revision still has to reach the bus."""
    if state.status == store.CLOSING:
        outbox.append((state.tenant, state.session_id, state.revision))


def _first_of_each(events: Sequence[GenerationEvent], ids: Callable[[GenerationEvent], list[str]]) -> list[GenerationEvent]:
    """``events`` without those sharing an id with an earlier one (so RETURNING tells new from replayed)."""
    seen: set[str] = set()
    out = []
    for event in events:
        keys = ids(event)
        if seen.isdisjoint(keys):
            seen.update(keys)
            out.append(event)
    return out


def _owned(assignment: set[tuple[str, int]]) -> str:
    """``topic[0,2] other[1]``: an assignment for the log."""
    topics: dict[str, list[int]] = {}
    for topic, partition in sorted(assignment):
        topics.setdefault(topic, []).append(partition)
    return " ".join(f"{topic}[{','.join(map(str, ps))}]" for topic, ps in topics.items())


def consumer_group(settings: Settings) -> str:
    """The ingest workers' consumer group (``Settings.group``)."""
    return settings.group("ingest")


def run(settings: Settings, stop: threading.Event | None = None) -> None:
    """Consume generations and feedback until ``stop`` is set (see the module docstring)."""
    stop = stop or threading.Event()
    engine = open_database(settings.database_url, settings.db.wait_s)
    sessions = make_session_factory(engine)
    bus = make_bus(settings)
    topics = settings.stage_topics("ingest")
    bus.ensure_topics([*topics, settings.topic("trajectories")])
    consumer = bus.consumer(consumer_group(settings), topics)
    producer = bus.producer()
    counters: Counter[str] = Counter()
    ingestor: Ingestor | None = Ingestor(settings, sessions, producer, counters)
    heartbeat = Beat(settings, "ingest", counters=counters)  # `flywheel health ingest`: a turn is a poll plus one batch
    outages = OutageWait(settings.database_url, settings.db.wait_s)
    log.info("ingest consuming %s", ", ".join(topics))
    previous: set[tuple[str, int]] = set()
    try:
        while not stop.is_set():
            heartbeat.beat()
            try:
                if ingestor is None:  # after an outage: start over as a restart would, still in the group
                    consumer.rewind()
                    ingestor = Ingestor(settings, sessions, producer, counters)
                ingestor.emit_pending()
                records = consumer.poll(timeout_s=POLL_TIMEOUT_S, max_records=MAX_RECORDS)
                if records:
                    ingestor.process(records, consumer)
                    consumer.commit(ingestor.committable(records, consumer))
                ingestor.close_deferred()
                assignment = consumer.assignment()
                if assignment != previous:
                    log.info("ingest owns %s", _owned(assignment) or "no partition")
                elif len(records) < MAX_RECORDS:
                    ingestor.close_inactive({p for topic, p in assignment if topic == ingestor.generations_topic})
                previous = assignment
            except Exception as exc:
                outages.ride_out("ingest", exc, lambda: (heartbeat.beat(), stay_in_group(consumer)), stop)
                ingestor = None  # what a crash loses; the database and the bus hold the rest
                counters["db_outages"] += 1
                continue
            outages.turn_done()
    finally:
        log.info("ingest stopping: %s", dict(counters))
        heartbeat.close()
        consumer.close()
        producer.close()
        bus.close()
        engine.dispose()
