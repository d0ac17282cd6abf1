"""Ingest's data access: raw events, session state and trajectories, as small functions over a Session.

No function commits: the worker owns the transaction, so one polled batch is persisted (or not)
as a whole. Raw events are inserted with ``ON CONFLICT DO NOTHING ... RETURNING``, so a replayed
event is a no-op and the caller learns which events were new.

Concurrency: several ingest workers (processes) share the database. Every change to a session
happens while its ``sessions`` row is locked (:func:`lock_sessions`: ``SELECT .. FOR UPDATE`` in
(tenant, session_id) order, so two batches never deadlock on each other; on SQLite the whole
transaction holds the database's write lock from ``BEGIN IMMEDIATE``). What a worker reads about
a locked session - its state, its stored events - is therefore final until it commits. The
inactivity sweep and the outbox take only rows nobody holds (``SKIP LOCKED``) and never wait.
Locked sessions are read into :class:`State` records, changed in memory and written back in one
statement (:func:`save_sessions`), so a batch costs a handful of statements, not a few per event.

Session status machine (``sessions.status``)::

    open ──close──▶ closing ──(trajectory produced and flushed)──▶ closed
      ▲   (no generations yet) ──▶ empty ─┐           │ new generation
      └────────────────────────────────────┴───────────┘

``closing`` is the outbox: the trajectory row of ``sessions.revision`` is committed but not yet
known to be on the bus. ``closed_at`` is the event time of the latest close (the newest event in
that trajectory) and is never cleared, so a session that was closed before re-closes with
``revision + 1``, and the late-feedback horizon counts from it in event time, whatever the lag.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, Integer, String, func, or_, select, tuple_, update
from sqlalchemy.orm import Session

from flywheel.db.models import Feedback, Generation, SessionState, Trajectory
from flywheel.db.session import JSONText, insert_ignore
from flywheel.events import FeedbackEvent, GenerationEvent, TrajectoryEvent, trajectory_id_for

OPEN, CLOSING, CLOSED, EMPTY = "open", "closing", "closed", "empty"
Key = tuple[str, str]  # (tenant, session_id)

_INT32 = (-(2**31), 2**31 - 1)


def generation_columns(event: GenerationEvent) -> dict[str, Any]:
    """The ``generations`` row of ``event`` without its payload (what :func:`check_fits` checks)."""
    return {
        "event_id": event.event_id,
        "generation_id": event.generation_id,
        "tenant": event.tenant,
        "session_id": event.session_id,
        "model_line": event.model_line,
        "model_version": event.model_version,
        "node_id": event.node_id,
        "ts": event.ts,
        "user_hash": event.user_hash,
    }


def feedback_columns(event: FeedbackEvent, state: str = "pending") -> dict[str, Any]:
    """The ``feedback`` row of ``event`` without its payload (what :func:`check_fits` checks)."""
    return {
        "event_id": event.event_id,
        "feedback_id": event.feedback_id,
        "tenant": event.tenant,
        "session_id": event.session_id,
        "generation_id": event.generation_id,
        "kind": event.kind,
        "signal": event.signal,
        "value": event.value,
        "ts": event.ts,
        "state": state,
    }


def check_fits(model: type[Any], row: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming the column if ``row`` would not fit ``model``'s table.

    Checked before the batch is written, so an event the database would refuse (a string longer
    than its column, an integer outside 32 bits) is dead-lettered instead of failing its batch.
    """
    for column in model.__table__.columns:
        value = row.get(column.name)
        if isinstance(value, str) and isinstance(column.type, String) and column.type.length is not None:
            if len(value) > column.type.length:
                raise ValueError(f"{column.name} has {len(value)} characters; at most {column.type.length} fit")
        elif isinstance(value, int) and isinstance(column.type, Integer) and not isinstance(column.type, BigInteger):
            if not _INT32[0] <= value <= _INT32[1]:
                raise ValueError(f"{column.name} = {value} does not fit a 32-bit integer")


def _insert(db: Session, model: type[Any]) -> Any:
    """The dialect's ``INSERT`` for ``model``'s table (Core: one multi-row statement per page)."""
    dialect = db.get_bind(mapper=model).dialect.name
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    elif dialect == "sqlite":
        from sqlalchemy.dialects.sqlite import insert
    else:
        raise NotImplementedError(f"ingest does not support the {dialect!r} dialect")
    return insert(model.__table__)


def _insert_new(db: Session, model: type[Any], rows: Sequence[Mapping[str, Any]]) -> set[str]:
    """Insert ``rows`` skipping any that break a unique key; the ``event_id`` of each new row."""
    if not rows:
        return set()
    stmt = _insert(db, model).on_conflict_do_nothing().returning(model.__table__.c.event_id)
    return set(db.execute(stmt, [dict(row) for row in rows]).scalars())


def insert_generations(db: Session, events: Iterable[GenerationEvent]) -> set[str]:
    """Persist generations; the event ids of those not stored before (by event or generation id)."""
    rows = [{**generation_columns(e), "payload": JSONText(e.model_dump_json())} for e in events]
    return _insert_new(db, Generation, rows)


def insert_feedback(db: Session, events: Iterable[tuple[FeedbackEvent, str]]) -> set[str]:
    """Persist ``(feedback, state)`` pairs; the event ids of those not stored before (by event or feedback id)."""
    rows = [{**feedback_columns(e, state), "payload": JSONText(e.model_dump_json())} for e, state in events]
    return _insert_new(db, Feedback, rows)


@dataclass
class State:
    """One locked ``sessions`` row, changed in memory and written back by :func:`save_sessions`."""

    tenant: str
    session_id: str
    status: str
    last_event_at: datetime
    closed_at: datetime | None
    revision: int

    @property
    def key(self) -> Key:
        return (self.tenant, self.session_id)


_STATE_FIELDS = [f.name for f in fields(State)]
_STATE = [SessionState.__table__.c[name] for name in _STATE_FIELDS]
_KEY = tuple_(SessionState.tenant, SessionState.session_id)


def _states(db: Session, stmt: Any) -> dict[Key, State]:
    return {(row.tenant, row.session_id): State(*row) for row in db.execute(stmt)}


def lock_sessions(db: Session, first_seen: Mapping[Key, datetime]) -> dict[Key, State]:
    """Create the sessions not stored yet (open, at their first event), lock them all, in key order."""
    keys = sorted(first_seen)
    insert_ignore(db, SessionState, [
        {"tenant": t, "session_id": s, "status": OPEN, "last_event_at": first_seen[(t, s)], "revision": 0}
        for t, s in keys
    ])
    return _states(db, select(*_STATE).where(_KEY.in_(keys)).order_by(*_KEY.clauses).with_for_update())


def save_sessions(db: Session, states: Iterable[State]) -> None:
    """Write locked sessions back, in one statement (an upsert: the rows exist and are ours)."""
    rows = [{name: getattr(state, name) for name in _STATE_FIELDS} for state in states]
    if rows:
        stmt = _insert(db, SessionState)
        upsert = stmt.on_conflict_do_update(
            index_elements=["tenant", "session_id"],
            set_={name: stmt.excluded[name] for name in ("status", "last_event_at", "closed_at", "revision")},
        )
        # RETURNING makes the driver send one multi-row statement (a page) instead of one per row.
        db.execute(upsert.returning(SessionState.__table__.c.tenant), rows).all()


def inactive_sessions(db: Session, before: datetime, limit: int = 500) -> list[tuple[str, str, datetime]]:
    """Open sessions whose newest event is older than ``before`` (oldest first), unlocked."""
    rows = db.execute(
        select(SessionState.tenant, SessionState.session_id, SessionState.last_event_at)
        .where(SessionState.status == OPEN, SessionState.last_event_at < before)
        .order_by(SessionState.last_event_at)
        .limit(limit)
    ).all()
    return [(r.tenant, r.session_id, r.last_event_at) for r in rows]


def lock_inactive(db: Session, keys: Sequence[Key], before: datetime) -> dict[Key, State]:
    """Lock those of ``keys`` still open and inactive since ``before``, skipping any another worker holds."""
    if not keys:
        return {}
    return _states(db, select(*_STATE)
                   .where(_KEY.in_(sorted(keys)), SessionState.status == OPEN, SessionState.last_event_at < before)
                   .order_by(*_KEY.clauses)
                   .with_for_update(skip_locked=True))


def latest_outcomes(db: Session, keys: Sequence[Key]) -> dict[Key, datetime]:
    """The time of each session's newest kept feedback that ended it (outcome or abandon)."""
    if not keys:
        return {}
    rows = db.execute(
        select(Feedback.tenant, Feedback.session_id, func.max(Feedback.ts))
        .where(tuple_(Feedback.tenant, Feedback.session_id).in_(sorted(keys)), Feedback.state != "expired",
               or_(Feedback.kind == "outcome", Feedback.signal == "abandon"))
        .group_by(Feedback.tenant, Feedback.session_id)
    )
    return {(tenant, session_id): ts for tenant, session_id, ts in rows}


class EventCache:
    """Decoded generations by ``event_id``, least recently used out first, bounded by tokens.

    Sound across workers because a stored generation never changes: a cached event is exactly the
    payload stored under its ``event_id`` (only events this worker inserted, or read back, go in).
    """

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.tokens = 0
        self._events: OrderedDict[str, GenerationEvent] = OrderedDict()
        self.hits = self.misses = 0

    @staticmethod
    def _size(event: GenerationEvent) -> int:
        return len(event.prompt_token_ids) + len(event.completion_token_ids)

    def put(self, event: GenerationEvent) -> None:
        size = self._size(event)
        if size > self.max_tokens or event.event_id in self._events:
            return
        self._events[event.event_id] = event
        self.tokens += size
        while self.tokens > self.max_tokens:
            _, old = self._events.popitem(last=False)
            self.tokens -= self._size(old)

    def purge(self, drop: Callable[[GenerationEvent], bool]) -> int:
        """Forget every cached event ``drop`` names (an erased subject's: flywheel/tombstones.py)."""
        gone = [event for event in self._events.values() if drop(event)]
        for event in gone:
            del self._events[event.event_id]
            self.tokens -= self._size(event)
        return len(gone)

    def get(self, event_id: str) -> GenerationEvent | None:
        event = self._events.get(event_id)
        if event is None:
            self.misses += 1
        else:
            self.hits += 1
            self._events.move_to_end(event_id)
        return event


def session_events(
    db: Session, keys: Sequence[Key], cache: EventCache | None = None
) -> dict[Key, tuple[list[GenerationEvent], list[FeedbackEvent]]]:
    """Each session's stored generations and its non-expired feedback, oldest first. Generations
    in ``cache`` are taken from it; only the others' payloads are read (and then cached)."""
    out: dict[Key, tuple[list[GenerationEvent], list[FeedbackEvent]]] = {key: ([], []) for key in keys}
    if not keys:
        return out
    wanted = tuple_(Generation.tenant, Generation.session_id).in_(sorted(keys))
    listed = db.execute(select(Generation.tenant, Generation.session_id, Generation.event_id)
                        .where(wanted).order_by(Generation.ts, Generation.generation_id)).all()
    found = {event_id: cache.get(event_id) for _, _, event_id in listed} if cache is not None else {}
    missing = [event_id for _, _, event_id in listed if found.get(event_id) is None]
    if missing:
        for event_id, payload in db.execute(select(Generation.event_id, Generation.payload)
                                            .where(Generation.event_id.in_(missing))):
            found[event_id] = event = GenerationEvent.model_validate(payload)
            if cache is not None:
                cache.put(event)
    for tenant, session_id, event_id in listed:
        out[(tenant, session_id)][0].append(found[event_id])
    fbs = db.execute(
        select(Feedback.tenant, Feedback.session_id, Feedback.payload)
        .where(tuple_(Feedback.tenant, Feedback.session_id).in_(sorted(keys)), Feedback.state != "expired")
        .order_by(Feedback.ts, Feedback.event_id)
    )
    for tenant, session_id, payload in fbs:
        out[(tenant, session_id)][1].append(FeedbackEvent.model_validate(payload))
    return out


def mark_feedback_joined(db: Session, keys: Sequence[Key]) -> int:
    if not keys:
        return 0
    result = db.execute(
        update(Feedback)
        .where(tuple_(Feedback.tenant, Feedback.session_id).in_(sorted(keys)), Feedback.state == "pending")
        .values(state="joined")
        .execution_options(synchronize_session=False)
    )
    return result.rowcount


def insert_trajectories(db: Session, trajectories: Sequence[tuple[TrajectoryEvent, str]]) -> None:
    """Store new trajectory revisions, each with its JSON; a revision stored before means the
    session state is corrupt."""
    rows = [
        {
            "trajectory_id": traj.trajectory_id,
            "revision": traj.revision,
            "event_id": traj.event_id,
            "tenant": traj.tenant,
            "session_id": traj.session_id,
            "model_line": traj.model_line,
            "closed_reason": traj.closed_reason,
            "ts": traj.ts,
            "payload": JSONText(encoded),
        }
        for traj, encoded in trajectories
    ]
    new = _insert_new(db, Trajectory, rows)
    if len(new) != len(rows):
        clash = sorted((t.session_id, t.revision) for t, _ in trajectories if t.event_id not in new)
        raise RuntimeError(f"trajectory revisions already stored (session state out of step): {clash[:5]}")


def trajectories_at(db: Session, revisions: Iterable[tuple[str, str, int]]) -> list[TrajectoryEvent]:
    """The stored trajectories of ``(tenant, session_id, revision)``, oldest first (by the indexed id)."""
    wanted = [(trajectory_id_for(tenant, session_id), revision) for tenant, session_id, revision in revisions]
    if not wanted:
        return []
    rows = db.execute(
        select(Trajectory.id, Trajectory.payload)
        .where(tuple_(Trajectory.trajectory_id, Trajectory.revision).in_(wanted))
        .order_by(Trajectory.id)
    )
    return [TrajectoryEvent.model_validate(payload) for _, payload in rows]


def claim_pending(db: Session, limit: int = 500, only: Iterable[tuple[str, str, int]] | None = None) -> list[State]:
    """Lock sessions in ``closing`` (oldest close first) that no other worker is emitting right now;
    with ``only``, just those of these ``(tenant, session_id, revision)``."""
    stmt = select(*_STATE).where(SessionState.status == CLOSING)
    if only is not None:
        wanted = sorted(only)
        if not wanted:
            return []
        stmt = stmt.where(tuple_(SessionState.tenant, SessionState.session_id, SessionState.revision).in_(wanted))
    stmt = stmt.order_by(SessionState.closed_at, *_KEY.clauses).limit(limit).with_for_update(skip_locked=True)
    return list(_states(db, stmt).values())


def mark_closed(db: Session, states: Sequence[State]) -> None:
    """``closing`` -> ``closed`` for claimed sessions whose trajectory is on the bus."""
    if states:
        db.execute(update(SessionState).where(_KEY.in_(sorted(s.key for s in states)))
                   .values(status=CLOSED).execution_options(synchronize_session=False))
