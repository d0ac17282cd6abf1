"""Ingest's data access: raw events, session state and trajectories, as small functions over a Session.

No function commits: the worker owns the transaction, so one polled batch is persisted (or not)
as a whole. Raw events are inserted with ``insert_ignore``, so a replayed event is a no-op and the
functions say whether a row was new.

Session status machine (``sessions.status``)::

    open ──close──▶ closing ──(trajectory produced and flushed)──▶ closed
      ▲   (no generations yet) ──▶ empty ─┐           │ new generation
      └────────────────────────────────────┴───────────┘

``closing`` is the outbox: the trajectory row of ``sessions.revision`` is committed but not yet
known to be on the bus. ``closed_at`` is the time of the latest close and is never cleared, so a
session that was closed before re-closes with ``revision + 1``; the late-feedback horizon counts
from it.
"""

from __future__ import annotations

from datetime import datetime
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from flywheel.db.models import Feedback, Generation, SessionState, Trajectory
from flywheel.db.session import insert_ignore
from flywheel.events import FeedbackEvent, GenerationEvent, TrajectoryEvent

OPEN, CLOSING, CLOSED, EMPTY = "open", "closing", "closed", "empty"


def insert_generation(db: Session, event: GenerationEvent) -> bool:
    """Persist a generation; ``False`` when it (or its generation id) is already stored."""
    row = {
        "event_id": event.event_id,
        "generation_id": event.generation_id,
        "tenant": event.tenant,
        "session_id": event.session_id,
        "model_line": event.model_line,
        "model_version": event.model_version,
        "node_id": event.node_id,
        "ts": event.ts,
        "payload": event.model_dump(mode="json"),
    }
    return insert_ignore(db, Generation, [row]) == 1


def insert_feedback(db: Session, event: FeedbackEvent, state: str) -> bool:
    """Persist a feedback event in ``state``; ``False`` when it (or its feedback id) is already stored."""
    row = {
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
        "payload": event.model_dump(mode="json"),
    }
    return insert_ignore(db, Feedback, [row]) == 1


def get_session(db: Session, tenant: str, session_id: str) -> SessionState | None:
    stmt = (
        select(SessionState)
        .where(SessionState.tenant == tenant, SessionState.session_id == session_id)
        .execution_options(populate_existing=True)
    )
    return db.execute(stmt).scalar_one_or_none()


def touch_session(db: Session, tenant: str, session_id: str, ts: datetime) -> SessionState:
    """Create the session (open) if new, and move ``last_event_at`` forward to ``ts`` if later."""
    insert_ignore(
        db,
        SessionState,
        [{"tenant": tenant, "session_id": session_id, "status": OPEN, "last_event_at": ts, "revision": 0}],
    )
    db.execute(
        update(SessionState)
        .where(SessionState.tenant == tenant, SessionState.session_id == session_id, SessionState.last_event_at < ts)
        .values(last_event_at=ts)
        .execution_options(synchronize_session=False)
    )
    state = get_session(db, tenant, session_id)
    assert state is not None
    return state


def set_status(
    db: Session, tenant: str, session_id: str, *, expect: tuple[str, ...], status: str, revision: int | None = None
) -> bool:
    """Move a session to ``status`` if it is in one of ``expect`` (and at ``revision`` when given).

    The conditional update is the claim: of two workers racing on one session, one wins.
    """
    stmt = update(SessionState).where(
        SessionState.tenant == tenant, SessionState.session_id == session_id, SessionState.status.in_(expect)
    )
    if revision is not None:
        stmt = stmt.where(SessionState.revision == revision)
    result = db.execute(stmt.values(status=status).execution_options(synchronize_session=False))
    return result.rowcount == 1


def claim_close(db: Session, state: SessionState, new_revision: int, now: datetime) -> bool:
    """``state`` (as read) -> ``closing`` at ``new_revision``; ``False`` if it changed meanwhile."""
    result = db.execute(
        update(SessionState)
        .where(
            SessionState.tenant == state.tenant,
            SessionState.session_id == state.session_id,
            SessionState.status == state.status,
            SessionState.revision == state.revision,
        )
        .values(status=CLOSING, revision=new_revision, closed_at=now)
        .execution_options(synchronize_session=False)
    )
    return result.rowcount == 1


def session_events(db: Session, tenant: str, session_id: str) -> tuple[list[GenerationEvent], list[FeedbackEvent]]:
    """The session's stored generations and its non-expired feedback, oldest first."""
    gens = db.execute(
        select(Generation.payload)
        .where(Generation.tenant == tenant, Generation.session_id == session_id)
        .order_by(Generation.ts, Generation.generation_id)
    ).scalars()
    fbs = db.execute(
        select(Feedback.payload)
        .where(Feedback.tenant == tenant, Feedback.session_id == session_id, Feedback.state != "expired")
        .order_by(Feedback.ts, Feedback.event_id)
    ).scalars()
    return [GenerationEvent.model_validate(p) for p in gens], [FeedbackEvent.model_validate(p) for p in fbs]


def mark_feedback_joined(db: Session, tenant: str, session_id: str) -> int:
    result = db.execute(
        update(Feedback)
        .where(Feedback.tenant == tenant, Feedback.session_id == session_id, Feedback.state == "pending")
        .values(state="joined")
        .execution_options(synchronize_session=False)
    )
    return result.rowcount


def insert_trajectory(db: Session, traj: TrajectoryEvent) -> bool:
    row = {
        "trajectory_id": traj.trajectory_id,
        "revision": traj.revision,
        "event_id": traj.event_id,
        "tenant": traj.tenant,
        "session_id": traj.session_id,
        "model_line": traj.model_line,
        "closed_reason": traj.closed_reason,
        "ts": traj.ts,
        "payload": traj.model_dump(mode="json"),
    }
    return insert_ignore(db, Trajectory, [row]) == 1


def inactive_sessions(db: Session, before: datetime, limit: int = 500) -> list[tuple[str, str]]:
    """Open sessions whose newest event is older than ``before``."""
    rows = db.execute(
        select(SessionState.tenant, SessionState.session_id)
        .where(SessionState.status == OPEN, SessionState.last_event_at < before)
        .order_by(SessionState.last_event_at)
        .limit(limit)
    ).all()
    return [(r.tenant, r.session_id) for r in rows]


def pending_emissions(db: Session, limit: int = 500) -> list[TrajectoryEvent]:
    """The trajectories of sessions still in ``closing``: committed, not yet known to be on the bus."""
    payloads = db.execute(
        select(Trajectory.payload)
        .join(
            SessionState,
            (Trajectory.tenant == SessionState.tenant)
            & (Trajectory.session_id == SessionState.session_id)
            & (Trajectory.revision == SessionState.revision),
        )
        .where(SessionState.status == CLOSING)
        .order_by(SessionState.closed_at)
        .limit(limit)
    ).scalars()
    return [TrajectoryEvent.model_validate(payload) for payload in payloads]
