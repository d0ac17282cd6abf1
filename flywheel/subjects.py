"""A data subject's rows: found by tenant and user or session, and exported as JSON Lines.

A data subject is one end user of one tenant, named by the id the client gave the gateway
(``flywheel.identity``), or one session of one tenant. Their rows, by kind (each line's ``type``):

- ``generation``: the user's generations (``tenant`` and ``user_hash``, the hash of the raw id under
  the deployment's secret, resolved as the gateway resolves it), or every generation of the session;
- ``session``: the sessions those generations belong to (ingest's ``sessions`` rows);
- ``feedback``: every feedback row of those sessions, and any that names one of those generations;
- ``trajectory``: every trajectory (each revision) of those sessions;
- ``scored``: every scored row of those trajectories (each reward spec version);
- ``trained``: the version each of those trajectories was trained into.

:func:`subject_rows` states each kind as one condition on its table, built of SQL subqueries (no
list of ids is held in memory): the one definition of "the subject's rows" that an export reads and
an erasure deletes. Every condition but the generations' reads the subject's generations, and the
``scored`` and ``trained`` ones read its trajectories: an erasure deletes in the reverse order of
:func:`subject_rows`, generations last.

Invariants:
- The raw user id is never written by this module: the export and its summary name the user by
  hash only. The id appears in an export only where the user typed it in content (a prompt).
- A user's session that also holds another end user's generations (another hash; a generation that
  names no user is no one else's) is shared: an export gives the subject's own generations of it,
  its ``sessions`` row and the feedback on those generations, and withholds its trajectories, their
  scores and trained rows, and the feedback on the whole session, which hold the other user's
  turns; the summary says how many sessions were shared (``whole_shared=True`` takes them whole).
- Rows are read in key order, :data:`BATCH` at a time, each batch in its own short transaction:
  memory stays bounded whatever the subject's size, and on SQLite (where a transaction takes the
  write lock) the gateway's writers wait for one batch at most, never for the whole export.

The command line (``flywheel data export``, its ``--out`` file and exit codes) is flywheel/data_cli.py;
the erasure that deletes these rows is flywheel/erasure.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from flywheel.identity import SECRET_FILE, SecretError, load_secret, user_hash
from flywheel.keys import check_tenant

if TYPE_CHECKING:  # the parser is built on every CLI call: SQLAlchemy is imported only when used
    from sqlalchemy import ColumnElement, Select
    from sqlalchemy.orm import Session, sessionmaker

#: The kinds of a subject's rows, in the order an export writes them (an erasure deletes backwards).
KINDS = ("generation", "session", "feedback", "trajectory", "scored", "trained")
#: Rows read per query (and per transaction).
BATCH = 500
#: The longest session id the gateway accepts (``flywheel.events``).
MAX_SESSION_CHARS = 256


@dataclass(frozen=True)
class Subject:
    """Whose rows: a tenant's end user (by hash) or a tenant's session; exactly one of the two."""

    tenant: str
    user_hash: str | None = None
    session_id: str | None = None

    def __post_init__(self) -> None:
        if (self.user_hash is None) == (self.session_id is None):
            raise ValueError("a subject is an end user or a session: name exactly one")

    def as_json(self) -> dict[str, Any]:
        return {"tenant": self.tenant, "user_hash": self.user_hash, "session_id": self.session_id}


def user_subject(secret: str, tenant: str, user: str) -> Subject:
    """End user ``user`` (the raw id a client sent) of ``tenant``, hashed as the gateway hashes it."""
    if not user:
        raise ValueError("an empty user id names no one (the gateway stores no hash for it)")
    return Subject(check_tenant(tenant), user_hash=user_hash(secret, tenant, user))


def deployment_secret(setting: str, data_dir: Path) -> str:
    """The gateway's user-id secret, resolved as the gateway resolves it (``gateway.user_id_secret``,
    else ``{data_dir}/user_id_secret``) but never made: with neither, no stored hash can be matched,
    and a secret made here would hand a gateway later started on this data_dir one that matches none.
    Raises :class:`flywheel.identity.SecretError` with the reason and the fix."""
    if not setting and not (data_dir / SECRET_FILE).exists():
        raise SecretError(f"no user-id secret: gateway.user_id_secret is empty and {data_dir / SECRET_FILE} does not "
                          "exist; run with the gateway's settings (its user_id_secret, or its data_dir)")
    return load_secret(setting, data_dir)


# Finding the rows ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rows:
    """One kind of a subject's rows: its table, the condition that selects them, the unique key that pages them."""

    kind: str
    model: type[Any]
    where: ColumnElement[bool]
    key: Any


def subject_rows(subject: Subject, *, whole_shared: bool = False) -> list[Rows]:
    """Every kind of ``subject``'s rows (:data:`KINDS` order); ``whole_shared`` takes the sessions a
    user shares with other end users whole (module docstring) instead of withholding their turns."""
    from sqlalchemy import and_, or_, select

    from flywheel.db.models import Feedback, Generation, ScoredTrajectoryRow, SessionState, TrainedTrajectory, Trajectory

    tenant = subject.tenant
    if subject.user_hash is not None:
        mine = and_(Generation.tenant == tenant, Generation.user_hash == subject.user_hash)
        every = select(Generation.session_id).where(mine).distinct().correlate(None)
        whole = every if whole_shared else every.where(Generation.session_id.not_in(shared_sessions(subject)))

        def of_sessions(column: Any, only_whole: bool = True) -> ColumnElement[bool]:
            return column.in_(whole if only_whole else every)
    else:
        mine = and_(Generation.tenant == tenant, Generation.session_id == subject.session_id)

        def of_sessions(column: Any, only_whole: bool = True) -> ColumnElement[bool]:
            return column == subject.session_id
    generation_ids = select(Generation.generation_id).where(mine).correlate(None)
    trajectories = and_(Trajectory.tenant == tenant, of_sessions(Trajectory.session_id))
    trajectory_ids = select(Trajectory.trajectory_id).where(trajectories).correlate(None)
    return [
        Rows("generation", Generation, mine, Generation.event_id),
        Rows("session", SessionState,
             and_(SessionState.tenant == tenant, of_sessions(SessionState.session_id, only_whole=False)),
             SessionState.session_id),
        Rows("feedback", Feedback,
             and_(Feedback.tenant == tenant,
                  or_(of_sessions(Feedback.session_id), Feedback.generation_id.in_(generation_ids))),
             Feedback.event_id),
        Rows("trajectory", Trajectory, trajectories, Trajectory.id),
        Rows("scored", ScoredTrajectoryRow,
             and_(ScoredTrajectoryRow.tenant == tenant, ScoredTrajectoryRow.trajectory_id.in_(trajectory_ids)),
             ScoredTrajectoryRow.id),
        Rows("trained", TrainedTrajectory, TrainedTrajectory.trajectory_id.in_(trajectory_ids),
             TrainedTrajectory.trajectory_id),
    ]


def shared_sessions(subject: Subject) -> Select[Any]:
    """The ids of the user's sessions that also hold another end user's generations (none for a
    session subject): a generation there names another hash of the same tenant."""
    from sqlalchemy import false, select
    from sqlalchemy.orm import aliased

    from flywheel.db.models import Generation

    if subject.user_hash is None:
        return select(Generation.session_id).where(false())
    other = aliased(Generation)
    mine = select(Generation.session_id).where(Generation.tenant == subject.tenant,
                                               Generation.user_hash == subject.user_hash).correlate(None)
    return (select(other.session_id)
            .where(other.tenant == subject.tenant, other.user_hash.is_not(None), other.user_hash != subject.user_hash,
                   other.session_id.in_(mine))
            .distinct().correlate(None))


def count_shared(sessions: sessionmaker[Session], subject: Subject) -> int:
    """How many of the user's sessions are shared with another end user."""
    from sqlalchemy import func, select

    with sessions() as session:
        return int(session.scalar(select(func.count()).select_from(shared_sessions(subject).subquery())) or 0)


def read_rows(sessions: sessionmaker[Session], rows: Rows, batch: int = BATCH) -> Iterator[Any]:
    """``rows``' rows in key order, ``batch`` per query, each query in its own transaction."""
    from sqlalchemy import select

    last: Any = None
    while True:
        query = select(rows.model).where(rows.where).order_by(rows.key).limit(batch)
        if last is not None:
            query = query.where(rows.key > last)
        with sessions() as session:
            found = list(session.scalars(query))
        yield from found
        if len(found) < batch:
            return
        last = getattr(found[-1], rows.key.key)


# Exporting -------------------------------------------------------------------------------------


def record(kind: str, row: Any) -> dict[str, Any]:
    """One export line's object: ``type`` and every column of ``row`` (payloads as the JSON they
    store, timestamps as ISO 8601 in UTC)."""
    from sqlalchemy import inspect

    out: dict[str, Any] = {"type": kind}
    for attr in inspect(row).mapper.column_attrs:
        value = getattr(row, attr.key)
        out[attr.key] = value.isoformat() if isinstance(value, datetime) else value
    return out


def export(sessions: sessionmaker[Session], subject: Subject, out: IO[bytes], *, whole_shared: bool = False,
           batch: int = BATCH) -> dict[str, int]:
    """Write ``subject``'s rows to ``out`` as JSON Lines: first a ``subject`` line (tenant, user hash
    or session id, when), then each kind's rows, last an ``end`` line with the counts (a file without
    it was cut short); returns how many rows of each kind were written."""
    from flywheel.jsonpolicy import db_dumps

    header = {"type": "subject", **subject.as_json(), "exported_at": datetime.now(UTC).isoformat()}
    out.write(db_dumps(header).encode() + b"\n")
    counts = dict.fromkeys(KINDS, 0)
    for rows in subject_rows(subject, whole_shared=whole_shared):
        for row in read_rows(sessions, rows, batch):
            out.write(db_dumps(record(rows.kind, row)).encode() + b"\n")
            counts[rows.kind] += 1
    out.write(db_dumps({"type": "end", "counts": counts, "rows": sum(counts.values())}).encode() + b"\n")
    return counts


def summary(subject: Subject, counts: dict[str, int], where: str, shared: int) -> str:
    """The line the command prints on stderr: whose rows, how many of each kind, where they went."""
    who = (f"user hash {subject.user_hash}" if subject.user_hash is not None else f"session {subject.session_id!r}")
    kinds = ", ".join(f"{counts[kind]} {kind}" for kind in KINDS)
    text = f"flywheel data export: tenant {subject.tenant}, {who}: {sum(counts.values())} rows ({kinds}) to {where}"
    if shared:
        text += (f"; {shared} session(s) also hold another end user's generations: the user's own generations and "
                 "the feedback on them are exported, the sessions' trajectories, scores and session feedback withheld")
    return text

