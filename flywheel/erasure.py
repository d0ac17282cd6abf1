"""Erasing a data subject: the tombstone, the batched deletion that resumes after a crash, and its audit.

``flywheel data forget --tenant T --user U`` (or ``--session S``; flywheel/data_cli.py) runs:

1. :func:`request`: one transaction writes the subject's ``erasures`` row (state ``pending``). From
   then on the subject is tombstoned (:func:`tombstoned` is what a reader asks) and the request is
   durable: whatever happens next, it is completed, never forgotten. The same transaction records
   the model versions the subject's trajectories were trained into (read before anything is
   deleted): **weights are not unlearned**, so the answer names them, and the guarantee is that
   nothing of the subject stored here is trained on again.
2. :func:`complete`: deletes every row of the subject (:func:`flywheel.subjects.subject_rows` with
   shared sessions whole: a trajectory that holds the subject's turns goes, even when another end
   user's turns are in it too; that user's own generations stay), kind by kind from the last
   (``trained``) to the generations, whose rows the other kinds' conditions read. At most
   :data:`BATCH` rows per transaction, so the hot tables are never locked for long. On SQLite the
   deleting connections set ``PRAGMA secure_delete`` (freed pages are overwritten with zeros), and
   the write-ahead log is checkpointed and truncated at the end (it would still hold the deleted
   pages). Then the row becomes ``done`` with what was deleted, audited with who asked and when.
3. A crash (kill -9) anywhere leaves the row ``pending``: :func:`resume` (``flywheel data forget
   --resume``) completes every pending request. A deletion is idempotent (what is gone is not found
   again), so a request completed twice deletes nothing the second time.

Not yet: the stages do not consult tombstones for records still in flight (the gateway spool, the
bus, ingest's open sessions, the trainer's buffer): a record of the subject that is stored after
:func:`complete` ran is not deleted by it; running the request again (``--resume`` after the
stages drained, or a second ``forget``) deletes it. That enforcement is the next step.

Invariants: the raw user id is never written (the subject is its keyed hash, flywheel/identity.py);
a request's row is written before any deletion and marked ``done`` only after the last one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from flywheel.subjects import KINDS, Subject, subject_rows

if TYPE_CHECKING:
    from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger(__name__)

#: Rows deleted per statement (and per transaction).
BATCH = 500


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
        return int(row.id)


def complete(sessions: sessionmaker[Session], erasure_id: int, batch: int = BATCH) -> Outcome:
    """Delete the erasure's rows and mark it done (module docstring, step 2); safe to repeat."""
    from sqlalchemy import delete, select

    from flywheel.db.models import Erasure

    with sessions() as db:
        row = db.get(Erasure, erasure_id)
        if row is None:
            raise KeyError(f"no erasure {erasure_id}")
        subject = Subject(row.tenant, user_hash=row.user_hash, session_id=row.session_id)
        counts = {kind: int(row.counts.get(kind, 0)) for kind in KINDS}
    sqlite = _is_sqlite(sessions)
    for rows in reversed(subject_rows(subject, whole_shared=True)):
        while True:
            keys = select(rows.key).where(rows.where).limit(batch).scalar_subquery()
            with sessions() as db, db.begin():
                if sqlite:  # freed pages are overwritten with zeros (per connection)
                    db.connection().exec_driver_sql("PRAGMA secure_delete = ON")
                # The condition again: a page key need not be unique across tenants (a session id).
                deleted = db.execute(delete(rows.model).where(rows.where, rows.key.in_(keys))
                                     .execution_options(synchronize_session=False)).rowcount or 0
                if deleted:  # counted in the deleting transaction: exact across a crash and a resume
                    counts[rows.kind] += deleted
                    db.get(Erasure, erasure_id).counts = dict(counts)
            if deleted < batch:
                break
    if sqlite:
        _checkpoint(sessions)
    with sessions() as db, db.begin():
        row = db.get(Erasure, erasure_id)
        row.state, row.completed_at, row.counts = "done", datetime.now(UTC), counts
        return Outcome(erasure_id, subject, counts, list(row.trained_into), row.requested_by, row.requested_at)


def pending(sessions: sessionmaker[Session]) -> list[int]:
    """The erasures a crash left unfinished, oldest first."""
    from sqlalchemy import select

    from flywheel.db.models import Erasure

    with sessions() as db:
        return [int(i) for i in db.scalars(select(Erasure.id).where(Erasure.state == "pending").order_by(Erasure.id))]


def resume(sessions: sessionmaker[Session]) -> Iterator[Outcome]:
    """Complete every pending erasure (module docstring, step 3)."""
    for erasure_id in pending(sessions):
        yield complete(sessions, erasure_id)


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
