"""The retention job: delete each tenant's rows older than its retention, in short batches.

Each tenant's policy (``[tenants.<name>]``, else ``[tenants."*"]``; flywheel/consent.py) names a
retention in days per kind; :func:`run_once` deletes, at ``now``:

- ``raw_events``: generations and feedback whose ``ts`` is older than the cutoff, except those of a
  session still live (ingest's ``sessions`` row is open, or its last event is newer than the
  cutoff: a session's trajectory is assembled from all its raw events, so a session's raw events
  go together once its last one expired); then the ``sessions`` rows closed before the cutoff
  whose trajectories are gone (the row holds the revision the session's next trajectory gets: a
  late event on a session recreated at revision 0 would clash with a stored revision);
- ``trajectories``: trajectory revisions older than the cutoff, and the ``trained_trajectories``
  row of a trajectory once its last revision is gone (it names nothing any more);
- ``scores``: scored rows older than the cutoff.

A tenant listed in the settings follows its own section only (as for ``data_use``); ``"*"`` covers
every tenant not listed. The kinds are independent: a trajectory may outlive its raw events (it is
the record that was trained on) and a score its trajectory, as each tenant chose.

Invariants:
- At most ``batch`` rows per statement and per transaction, the oldest first on the tables' ``ts``
  indexes (revision 0011): the hot tables are never locked for long, and the gateway's and ingest's
  writers wait for one batch at most. After each batch the job rests ``rest`` times as long as the
  batch took (``retention.rest``), so on a busy machine it takes a bounded share of the CPU and the
  disk, not all it can get: the hot path's latency stays near its own (bench/retention.py). A crash
  loses nothing but the batch in flight: the job is idempotent (what is gone is not found again) and
  the next run goes on.
- On SQLite the deleting connections set ``PRAGMA secure_delete`` (freed pages are zeroed) and the
  write-ahead log is checkpointed and truncated at the end, as an erasure does (flywheel/erasure.py).
- Pure of settings IO: the caller passes the tenants' policies and the session factory; ``now`` is
  a parameter, so tests and the benchmark choose the clock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from flywheel.consent import ANY_TENANT, RETAINED, TenantPolicy

if TYPE_CHECKING:
    from sqlalchemy import ColumnElement
    from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger(__name__)

#: Rows deleted per statement (and per transaction).
BATCH = 2_000
#: Seconds the janitor's job rests per second of deleting (module docstring).
REST = 1.5
#: The tables the job deletes from, in the order it visits them (the report's keys).
TABLES = ("scored_trajectories", "trajectories", "trained_trajectories", "generations", "feedback", "sessions")


class RetentionSettings(BaseModel):
    """``[retention]``: how often the ``janitor`` role runs the job, its batch size and its rests."""

    model_config = ConfigDict(extra="forbid")

    #: Seconds between two runs of the janitor's tasks.
    interval_s: float = Field(3600.0, gt=0)
    #: Rows deleted per statement and transaction.
    batch: int = Field(BATCH, ge=1, le=100_000)
    #: Seconds of rest after each batch per second the batch took (0: delete flat out).
    rest: float = Field(REST, ge=0, le=100)


@dataclass
class Report:
    """What one run deleted (or, dry, would delete) per table, and how fast."""

    deleted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TABLES, 0))
    seconds: float = 0.0
    batches: int = 0
    dry_run: bool = False

    @property
    def rows(self) -> int:
        return sum(self.deleted.values())

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0

    def as_json(self) -> dict[str, Any]:
        return {"dry_run": self.dry_run, "deleted": dict(self.deleted), "rows": self.rows, "batches": self.batches,
                "seconds": round(self.seconds, 3), "rows_per_s": round(self.rows_per_s, 1)}


@dataclass(frozen=True)
class Scope:
    """Whose rows one cutoff applies to: one tenant, or every tenant but the listed ones."""

    tenant: str | None
    unlisted: tuple[str, ...] = ()

    def where(self, column: Any) -> ColumnElement[bool]:
        if self.tenant is not None:
            return column == self.tenant
        return column.not_in(self.unlisted) if self.unlisted else column.is_not(None)


def cutoffs(tenants: Mapping[str, TenantPolicy], kind: str, now: datetime) -> list[tuple[Scope, datetime]]:
    """Each scope's cutoff for ``kind`` (one of :data:`flywheel.consent.RETAINED`); scopes kept forever are absent."""
    if kind not in RETAINED:
        raise ValueError(f"unknown retained kind {kind!r}: one of {RETAINED}")
    listed = tuple(sorted(name for name in tenants if name != ANY_TENANT))
    out = []
    for name in listed:
        days = tenants[name].retention_days.days(kind)
        if days is not None:
            out.append((Scope(name), now - timedelta(days=days)))
    every = tenants.get(ANY_TENANT)
    days = every.retention_days.days(kind) if every is not None else None
    if days is not None:
        out.append((Scope(None, listed), now - timedelta(days=days)))
    return out


def run_once(tenants: Mapping[str, TenantPolicy], sessions: sessionmaker[Session], now: datetime | None = None,
             *, batch: int = BATCH, rest: float = 0.0, dry_run: bool = False,
             progress: Callable[[], object] | None = None) -> Report:
    """Delete every expired row (module docstring); ``dry_run`` counts them instead (each table as
    it stands: the trained and session rows that a run's own deletions free are not counted).
    After each batch the job sleeps ``rest`` times as long as the batch took. ``progress`` is
    called after every batch (the janitor's heartbeat)."""
    if batch < 1:
        raise ValueError("batch must be at least 1")
    now = now or datetime.now(UTC)
    report = Report(dry_run=dry_run)
    started = time.perf_counter()
    for kind in reversed(RETAINED):  # scores, trajectories, then raw events: a session row outlives its trajectories
        for scope, before in cutoffs(tenants, kind, now):
            for table, plan in _plans(kind, scope, before):
                if dry_run:
                    report.deleted[table] += _count(sessions, plan)
                    continue
                while True:
                    took = time.perf_counter()
                    deleted = _delete_batch(sessions, plan, batch, report)
                    report.batches += 1
                    if progress is not None:
                        progress()
                    if deleted < batch:
                        break
                    if rest > 0:
                        time.sleep(rest * (time.perf_counter() - took))
    if not dry_run and report.rows and _is_sqlite(sessions):
        _checkpoint(sessions)
    report.seconds = time.perf_counter() - started
    if report.rows:
        log.info("retention: %s %d rows in %.1f s (%s)", "would delete" if dry_run else "deleted", report.rows,
                 report.seconds, ", ".join(f"{n} {t}" for t, n in report.deleted.items() if n))
    return report


@dataclass(frozen=True)
class _Plan:
    """One table's expired rows under one scope: the condition, the key that pages them, the order."""

    model: type[Any]
    where: ColumnElement[bool]
    key: Any
    order: Any


def _plans(kind: str, scope: Scope, before: datetime) -> list[tuple[str, _Plan]]:
    from sqlalchemy import and_, exists, or_, select

    from flywheel.db.models import Feedback, Generation, ScoredTrajectoryRow, SessionState, Trajectory

    if kind == "raw_events":
        def not_live(model: Any) -> ColumnElement[bool]:
            live = (select(SessionState.session_id)
                    .where(SessionState.tenant == model.tenant, SessionState.session_id == model.session_id,
                           or_(SessionState.status == "open", SessionState.last_event_at >= before)))
            return ~exists(live)

        # A session's row stays while a trajectory of it does: it holds the revision the next one gets.
        trajectories = select(Trajectory.id).where(Trajectory.tenant == SessionState.tenant,
                                                   Trajectory.session_id == SessionState.session_id)
        return [
            ("generations", _Plan(Generation, and_(Generation.ts < before, scope.where(Generation.tenant),
                                                   not_live(Generation)), Generation.event_id, Generation.ts)),
            ("feedback", _Plan(Feedback, and_(Feedback.ts < before, scope.where(Feedback.tenant), not_live(Feedback)),
                               Feedback.event_id, Feedback.ts)),
            ("sessions", _Plan(SessionState, and_(SessionState.status.in_(("closed", "empty")),
                                                  SessionState.last_event_at < before, scope.where(SessionState.tenant),
                                                  ~exists(trajectories)),
                               SessionState.session_id, SessionState.last_event_at)),
        ]
    if kind == "trajectories":
        return [("trajectories", _Plan(Trajectory, and_(Trajectory.ts < before, scope.where(Trajectory.tenant)),
                                       Trajectory.id, Trajectory.ts))]
    return [("scored_trajectories", _Plan(ScoredTrajectoryRow, and_(ScoredTrajectoryRow.ts < before,
                                                                    scope.where(ScoredTrajectoryRow.tenant)),
                                          ScoredTrajectoryRow.id, ScoredTrajectoryRow.ts))]


def _count(sessions: sessionmaker[Session], plan: _Plan) -> int:
    from sqlalchemy import func, select

    with sessions() as db:
        return int(db.scalar(select(func.count()).select_from(plan.model).where(plan.where)) or 0)


def _delete_batch(sessions: sessionmaker[Session], plan: _Plan, batch: int, report: Report) -> int:
    """Delete up to ``batch`` of the plan's rows, oldest first, in one transaction; how many went."""
    from sqlalchemy import delete, exists, select

    from flywheel.db.models import TrainedTrajectory, Trajectory

    table = plan.model.__tablename__
    with sessions() as db, db.begin():
        if _is_sqlite(sessions):  # freed pages are overwritten with zeros (per connection)
            db.connection().exec_driver_sql("PRAGMA secure_delete = ON")
        if plan.model is Trajectory:  # their ids, for the trained rows the last revision takes along
            rows = db.execute(select(Trajectory.id, Trajectory.trajectory_id).where(plan.where)
                              .order_by(plan.order).limit(batch)).all()
            if not rows:
                return 0
            deleted = db.execute(delete(Trajectory).where(Trajectory.id.in_([r.id for r in rows]))
                                 .execution_options(synchronize_session=False)).rowcount or 0
            ids = sorted({r.trajectory_id for r in rows})
            left = exists(select(Trajectory.id).where(Trajectory.trajectory_id == TrainedTrajectory.trajectory_id))
            trained = db.execute(delete(TrainedTrajectory).where(TrainedTrajectory.trajectory_id.in_(ids), ~left)
                                 .execution_options(synchronize_session=False)).rowcount or 0
            report.deleted["trained_trajectories"] += trained
        else:
            # The condition again: a page key need not be unique (a session id across tenants).
            keys = select(plan.key).where(plan.where).order_by(plan.order).limit(batch).scalar_subquery()
            deleted = db.execute(delete(plan.model).where(plan.where, plan.key.in_(keys))
                                 .execution_options(synchronize_session=False)).rowcount or 0
    report.deleted[table] += deleted
    return deleted


def _is_sqlite(sessions: sessionmaker[Session]) -> bool:
    bind = sessions.kw.get("bind")
    return bind is not None and bind.dialect.name == "sqlite"


def _checkpoint(sessions: sessionmaker[Session]) -> None:
    """Copy the WAL into the database file and truncate it: the deleted pages leave the log."""
    raw = sessions.kw["bind"].raw_connection()  # outside any transaction
    try:
        busy, _, _ = raw.cursor().execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
    finally:
        raw.close()
    if busy:
        log.warning("retention: the WAL checkpoint was blocked by a reader; it is truncated at the next checkpoint")
