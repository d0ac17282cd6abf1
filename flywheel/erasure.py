"""Erasing a data subject: the tombstone, the batched deletion that resumes after a crash, and its audit.

``flywheel data forget --tenant T --user U`` (or ``--session S``; flywheel/data_cli.py) runs:

1. :func:`request`: one transaction writes the subject's ``erasures`` row (state ``pending``) and
   the sessions it covers (``erasure_sessions``: a user's sessions with a generation of theirs sent
   before the request; a session subject's one session). From then on the subject is tombstoned
   (:func:`tombstoned` is what a reader asks) and the request is durable: whatever happens next, it
   is completed, never forgotten. The same transaction records the model versions the subject's
   trajectories were trained into (read before anything is deleted): **weights are not
   unlearned**, so the answer names them, and the guarantee is that nothing of the subject stored
   here is trained on again.
2. :func:`complete`: deletes, session by session, every row of the covered sessions
   (:func:`flywheel.subjects.subject_rows` of the session; a shared session's trajectory goes
   whole, even when another end user's turns are in it too, but of its generations only the
   erased user's), kind by kind from the last (``trained``) to the generations, whose rows the
   other kinds' conditions read. At most :data:`BATCH` rows per transaction, so the hot tables are
   never locked for long. On SQLite the deleting connections set ``PRAGMA secure_delete`` (freed
   pages are overwritten with zeros), and the write-ahead log is checkpointed and truncated at the
   end (it would still hold the deleted pages). Then the row becomes ``done`` with what was
   deleted, audited with who asked and when.
3. A crash (kill -9) anywhere leaves the row ``pending``: :func:`resume` (``flywheel data forget
   --resume``, and the janitor each turn for requests older than :data:`STALE_AFTER`) completes
   every pending request. A deletion is idempotent (what is gone is not found
   again), so a request completed twice deletes nothing the second time.

In flight: from the moment the row commits, the stages drop whatever of the subject is still on
its way (the gateway spool and the bus, ingest's open sessions, the rewards stage, the trainer's
buffer and the samples its checkpoints hold): flywheel/tombstones.py says what they drop. The
request records the subject's sessions (``erasure_sessions``), which is all the later stages can
see. A stage learns of a tombstone within about a second, so :func:`complete` deletes in two
passes, :data:`SETTLE_S` apart: what a stage stored in between goes in the second. The janitor's
:func:`sweep` finds, for a while after (:data:`SWEEP_HORIZON`: a stage that was down, a spool
shipped late), what was stored of a subject since and passes over it again; versions a late pass
finds trained on the subject join the answer's ``trained_into``. What the user sends after the
request, in sessions of its own, is not theirs to erase by this request (flywheel/tombstones.py).

Invariants: the raw user id is never written (the subject is its keyed hash, flywheel/identity.py);
a request's row is written before any deletion and marked ``done`` only after the last one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from flywheel.events import trajectory_id_for
from flywheel.subjects import KINDS, Rows, Subject, subject_rows

if TYPE_CHECKING:
    from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger(__name__)

#: Rows deleted per statement (and per transaction).
BATCH = 500
#: Seconds between an erasure's two deletion passes: longer than a stage takes to see a tombstone
#: (flywheel.tombstones.REFRESH_S) and to finish the batch it was writing.
SETTLE_S = 3.0
#: How long after its request the janitor's :func:`sweep` still looks for an erasure's rows.
SWEEP_HORIZON = timedelta(days=1)
#: A pending erasure this old lost the process that took it: the janitor completes it.
STALE_AFTER = timedelta(minutes=5)


@dataclass(frozen=True)
class Outcome:
    """A completed erasure: its id, the subject, what was deleted, the versions trained on it."""

    erasure_id: int
    subject: Subject
    counts: dict[str, int]
    trained_into: list[dict[str, Any]]
    requested_by: str
    requested_at: datetime


def request(sessions: sessionmaker[Session], subject: Subject, requested_by: str) -> int:
    """Tombstone ``subject`` (module docstring, step 1); the erasure's id."""
    from sqlalchemy import select

    from flywheel.db.models import Erasure, TrainedTrajectory

    trained = next(r for r in subject_rows(subject, whole_shared=True) if r.kind == "trained")
    with sessions() as db, db.begin():
        versions = db.execute(select(TrainedTrajectory.model_line, TrainedTrajectory.version)
                              .where(trained.where).distinct()
                              .order_by(TrainedTrajectory.model_line, TrainedTrajectory.version)).all()
        row = Erasure(tenant=subject.tenant, user_hash=subject.user_hash, session_id=subject.session_id,
                      requested_by=requested_by[:128], requested_at=datetime.now(UTC), state="pending",
                      counts={}, trained_into=[{"model_line": line, "version": int(v)} for line, v in versions])
        db.add(row)
        db.flush()
        _cover_sessions(db, int(row.id), subject, row.requested_at)
        return int(row.id)


def complete(sessions: sessionmaker[Session], erasure_id: int, batch: int = BATCH,
             settle_s: float = SETTLE_S) -> Outcome:
    """Delete the erasure's rows and mark it done (module docstring, step 2); safe to repeat."""
    from flywheel.db.models import Erasure

    with sessions() as db:
        row = db.get(Erasure, erasure_id)
        if row is None:
            raise KeyError(f"no erasure {erasure_id}")
        subject = Subject(row.tenant, user_hash=row.user_hash, session_id=row.session_id)
        requested_at = row.requested_at
    _erase(sessions, erasure_id, subject, requested_at, batch)
    if settle_s > 0:  # what a stage stored before it saw the tombstone (module docstring)
        time.sleep(settle_s)
        _erase(sessions, erasure_id, subject, requested_at, batch)
    if _is_sqlite(sessions):
        _checkpoint(sessions)
    with sessions() as db, db.begin():
        row = db.get(Erasure, erasure_id)
        row.state, row.completed_at = "done", datetime.now(UTC)
        counts = {kind: int(row.counts.get(kind, 0)) for kind in KINDS}
        return Outcome(erasure_id, subject, counts, list(row.trained_into), row.requested_by, row.requested_at)


def sweep(sessions: sessionmaker[Session], horizon: timedelta = SWEEP_HORIZON, batch: int = BATCH) -> int:
    """Delete what stages stored of a subject after its erasure was done (module docstring), for
    erasures done within ``horizon``; how many rows that deleted. The janitor runs it: two indexed
    probes find the erasures with anything left (a row of a tombstoned session, or a generation
    of an erased user sent before the request), and only those are passed over again."""
    from sqlalchemy import and_, select

    from flywheel.db.models import Erasure, ErasureSession, Generation, ScoredTrajectoryRow, SessionState, TrainedTrajectory

    since = datetime.now(UTC) - horizon
    recent = select(Erasure.id).where(Erasure.state == "done", Erasure.requested_at >= since)
    with sessions() as db:
        dirty = set(db.scalars(select(ErasureSession.erasure_id).join(SessionState, and_(
            SessionState.tenant == ErasureSession.tenant, SessionState.session_id == ErasureSession.session_id))
            .where(ErasureSession.erasure_id.in_(recent)).distinct()))
        for table in (ScoredTrajectoryRow, TrainedTrajectory):  # stored after the trajectories went
            dirty |= set(db.scalars(select(ErasureSession.erasure_id).join(
                table, table.trajectory_id == ErasureSession.trajectory_id)
                .where(ErasureSession.erasure_id.in_(recent)).distinct()))
        dirty |= set(db.scalars(select(Erasure.id).join(Generation, and_(
            Generation.tenant == Erasure.tenant, Generation.user_hash == Erasure.user_hash,
            Generation.ts <= Erasure.requested_at)).where(Erasure.id.in_(recent)).distinct()))
        erasures = db.execute(select(Erasure.id, Erasure.tenant, Erasure.user_hash, Erasure.session_id,
                                     Erasure.requested_at).where(Erasure.id.in_(sorted(dirty)))
                              .order_by(Erasure.id)).all()
    found = 0
    for erasure_id, tenant, user_hash, session_id, requested_at in erasures:
        subject = Subject(tenant, user_hash=user_hash, session_id=session_id)
        found += _erase(sessions, int(erasure_id), subject, requested_at, batch)
    if found:
        log.warning("erasure sweep: %d rows of erased subjects were stored after their erasure; deleted", found)
        if _is_sqlite(sessions):
            _checkpoint(sessions)
    return found


def _erase(sessions: sessionmaker[Session], erasure_id: int, subject: Subject, requested_at: datetime,
           batch: int) -> int:
    """One deletion pass over every session the erasure covers (:func:`_session_rows`); counts
    and trained versions join the erasure's row. Rows deleted."""
    from sqlalchemy import delete, select

    from flywheel.db.models import Erasure, ErasureSession, TrainedTrajectory

    with sessions() as db, db.begin():
        _cover_sessions(db, erasure_id, subject, requested_at)
        covered = list(db.scalars(select(ErasureSession.session_id).where(ErasureSession.erasure_id == erasure_id)
                                  .order_by(ErasureSession.session_id)))
    sqlite = _is_sqlite(sessions)
    total = 0
    for session_id in covered:
        kinds = _session_rows(subject, session_id)
        trained = next(r for r in kinds if r.kind == "trained")
        with sessions() as db, db.begin():
            versions = db.execute(select(TrainedTrajectory.model_line, TrainedTrajectory.version)
                                  .where(trained.where).distinct()).all()
            if versions:  # read before the trained rows go: the answer names every version
                _add_versions(db.get(Erasure, erasure_id, with_for_update=True), versions)
        for rows in reversed(kinds):
            while True:
                keys = select(rows.key).where(rows.where).limit(batch).scalar_subquery()
                with sessions() as db, db.begin():
                    if sqlite:  # freed pages are overwritten with zeros (per connection)
                        db.connection().exec_driver_sql("PRAGMA secure_delete = ON")
                    # The condition again: a page key need not be unique across tenants (a session id).
                    deleted = db.execute(delete(rows.model).where(rows.where, rows.key.in_(keys))
                                         .execution_options(synchronize_session=False)).rowcount or 0
                    if deleted:  # counted in the deleting transaction: exact across a crash and a resume
                        _add_count(db.get(Erasure, erasure_id, with_for_update=True), rows.kind, deleted)
                        total += deleted
                if deleted < batch:
                    break
    return total


def erase_found(db: Session, erasure_id: int, tenant: str, session_ids: set[str], *,
                user_hash: str | None = None) -> int:
    """Within ``db``'s transaction, delete what is stored of sessions a stage just found to be an
    erased user's (flywheel/tombstones.py; a few rows: feedback read before the session's
    generations, say), counted in the erasure; their other users' generations stay, and the user's
    own (``user_hash``: a stage that stored them before it knew of the erasure) go. Rows deleted."""
    from sqlalchemy import and_, delete

    from flywheel.db.models import Erasure

    total = 0
    for session_id in sorted(session_ids):
        for rows in reversed(subject_rows(Subject(tenant, session_id=session_id))):
            if rows.kind == "generation" and user_hash is None:
                continue
            if rows.kind == "generation":
                rows = replace(rows, where=and_(rows.where, rows.model.user_hash == user_hash))
            deleted = db.execute(delete(rows.model).where(rows.where)
                                 .execution_options(synchronize_session=False)).rowcount or 0
            if deleted:
                _add_count(db.get(Erasure, erasure_id, with_for_update=True), rows.kind, deleted)
                total += deleted
    return total


def _session_rows(subject: Subject, session_id: str) -> list[Rows]:
    """The rows of one session an erasure covers: all of them, but for an erased user only their
    own generations (another end user's turns in a shared session stay; its trajectories go whole)."""
    from sqlalchemy import and_, or_

    from flywheel.db.models import Generation, ScoredTrajectoryRow, TrainedTrajectory

    tenant, trajectory_id = subject.tenant, trajectory_id_for(subject.tenant, session_id)
    by_kind = {rows.kind: rows for rows in subject_rows(Subject(tenant, session_id=session_id))}
    # Scored and trained rows also by the session's trajectory id: a stage may store them after
    # an earlier pass deleted the trajectories their conditions read.
    by_kind["scored"] = Rows("scored", ScoredTrajectoryRow, or_(by_kind["scored"].where, and_(
        ScoredTrajectoryRow.tenant == tenant, ScoredTrajectoryRow.trajectory_id == trajectory_id)), ScoredTrajectoryRow.id)
    by_kind["trained"] = Rows("trained", TrainedTrajectory, or_(by_kind["trained"].where,
                                                                TrainedTrajectory.trajectory_id == trajectory_id),
                              TrainedTrajectory.trajectory_id)
    if subject.user_hash is not None:
        by_kind["generation"] = Rows("generation", Generation, and_(
            Generation.tenant == tenant, Generation.session_id == session_id, Generation.user_hash == subject.user_hash),
            Generation.event_id)
    return [by_kind[kind] for kind in KINDS]


def _cover_sessions(db: Session, erasure_id: int, subject: Subject, requested_at: datetime) -> None:
    """Record the subject's sessions in ``erasure_sessions`` (flywheel/tombstones.py): for a user,
    the sessions of their generations sent before the request, as stored now; a session subject
    is its own one session."""
    from sqlalchemy import select

    from flywheel.db.models import ErasureSession, Generation
    from flywheel.db.session import insert_ignore

    if subject.session_id is not None:
        found = [subject.session_id]
    else:
        found = list(db.scalars(select(Generation.session_id).where(
            Generation.tenant == subject.tenant, Generation.user_hash == subject.user_hash,
            Generation.ts <= requested_at).distinct()))
    now = datetime.now(UTC)
    insert_ignore(db, ErasureSession, [{"erasure_id": erasure_id, "tenant": subject.tenant, "session_id": session_id,
                                        "trajectory_id": trajectory_id_for(subject.tenant, session_id), "added_at": now}
                                       for session_id in found])


# The erasure's row is read FOR UPDATE before it is changed: two passes over one erasure at once
# (a resume beside a forget still running) count every deleted row once, and lose no version.


def _add_count(row: Any, kind: str, deleted: int) -> None:
    row.counts = {**row.counts, kind: int(row.counts.get(kind, 0)) + deleted}


def _add_versions(row: Any, versions: Sequence[Any]) -> None:
    known = {(v["model_line"], v["version"]) for v in row.trained_into}
    added = [{"model_line": line, "version": int(v)} for line, v in versions if (line, int(v)) not in known]
    row.trained_into = sorted([*row.trained_into, *added], key=lambda v: (v["model_line"], v["version"]))


def pending(sessions: sessionmaker[Session], older_than: timedelta | None = None) -> list[int]:
    """The erasures a crash left unfinished, oldest first; with ``older_than``, only those requested
    at least that long ago (younger ones may still be on their way in the process that took them)."""
    from sqlalchemy import select

    from flywheel.db.models import Erasure

    query = select(Erasure.id).where(Erasure.state == "pending")
    if older_than is not None:
        query = query.where(Erasure.requested_at <= datetime.now(UTC) - older_than)
    with sessions() as db:
        return [int(i) for i in db.scalars(query.order_by(Erasure.id))]


def resume(sessions: sessionmaker[Session], older_than: timedelta | None = None) -> Iterator[Outcome]:
    """Complete every pending erasure (module docstring, step 3); ``older_than`` as for :func:`pending`."""
    for erasure_id in pending(sessions, older_than):
        yield complete(sessions, erasure_id)


def pending_for(sessions: sessionmaker[Session], subject: Subject) -> tuple[int | None, int]:
    """The oldest pending erasure of ``subject`` (None: there is none) and how many erasures of its
    tenant are pending: what the data routes read before they take another request."""
    from sqlalchemy import func, select

    from flywheel.db.models import Erasure

    same = (Erasure.user_hash == subject.user_hash if subject.user_hash is not None
            else Erasure.session_id == subject.session_id)
    with sessions() as db:
        mine = db.scalar(select(func.min(Erasure.id)).where(Erasure.tenant == subject.tenant, Erasure.state == "pending",
                                                            same))
        count = db.scalar(select(func.count()).select_from(Erasure).where(Erasure.tenant == subject.tenant,
                                                                          Erasure.state == "pending"))
    return (None if mine is None else int(mine)), int(count or 0)


def tombstoned(db: Session, subject: Subject) -> bool:
    """Whether an erasure (pending or done) names ``subject``: its records are to be dropped."""
    from sqlalchemy import select

    from flywheel.db.models import Erasure

    query = select(Erasure.id).where(Erasure.tenant == subject.tenant, Erasure.user_hash == subject.user_hash
                                     if subject.user_hash is not None else Erasure.session_id == subject.session_id)
    return db.scalar(query.limit(1)) is not None


def _is_sqlite(sessions: sessionmaker[Session]) -> bool:
    bind = sessions.kw.get("bind")
    return bind is not None and bind.dialect.name == "sqlite"


def _checkpoint(sessions: sessionmaker[Session]) -> None:
    """Copy the WAL into the database file and truncate it: the deleted pages leave the log."""
    raw = sessions.kw["bind"].raw_connection()  # outside any transaction (the engine's begin hook opens one)
    try:
        busy, _, _ = raw.cursor().execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
    finally:
        raw.close()
    if busy:  # a reader held the log: the pages are zeroed (secure_delete) but the log keeps its size
        log.warning("erasure: the WAL checkpoint was blocked by a reader; it is truncated at the next checkpoint")
