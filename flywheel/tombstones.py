"""Tombstones as the stages see them: which records in flight to drop because their subject was erased.

An erasure (flywheel/erasure.py) is a tombstone from the moment its ``erasures`` row commits. The
stages hold a :class:`Tombstones` each and drop, before anything is stored, scored or trained:

- every record of a **tombstoned session** (``erasure_sessions``: the subject's sessions when it was
  asked, the session a ``--session`` erasure names, and the sessions a stage found in flight later),
  whenever it was sent: a later turn's prompt carries the earlier turns;
- every generation of a **tombstoned user** (tenant and keyed hash) sent at or before the erasure
  was requested. Its session becomes tombstoned (:meth:`Tombstones.cover`, by ingest, the one stage
  that sees user hashes): whatever else of that session is in flight goes too. What the user sends
  after the request, in a session of its own, is new data and kept.

Trajectories and scored trajectories carry no user hash, only their session: the session rule is
what the rewards stage and the trainer apply. A session shared with other end users is dropped
whole from then on (their later turns in it too); their stored rows stay (flywheel/erasure.py).

The set is read from the database and refreshed at most every ``refresh_s`` seconds (one indexed
query per table for what was added since the last refresh, with :data:`OVERLAP` for clocks and
transactions that commit late), so a stage sees a new tombstone within about ``refresh_s``. An
erasure deletes again after :data:`flywheel.erasure.SETTLE_S`, and the janitor's sweep later
still, whatever a stage stored in that window.

Invariants: a tombstone is never lifted (no row is ever removed from the set); the check is pure
set membership, no query per record.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from flywheel.events import trajectory_id_for

if TYPE_CHECKING:
    from sqlalchemy.orm import Session, sessionmaker

#: Seconds between two reads of the tombstones by one stage.
REFRESH_S = 1.0
#: Rows added this long before the previous refresh are read again (clock skew between hosts, a
#: transaction that committed after a later one).
OVERLAP = timedelta(minutes=5)

Key = tuple[str, str]


class Tombstones:
    """The tombstoned users and sessions one stage knows (module docstring)."""

    def __init__(self, sessions: sessionmaker[Session] | None, refresh_s: float = REFRESH_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._db = sessions
        self.refresh_s = refresh_s
        self._clock = clock
        #: (tenant, user_hash) -> (the newest erasure's id, when it was requested)
        self.users: dict[Key, tuple[int, datetime]] = {}
        #: (tenant, session_id)
        self.sessions: set[Key] = set()
        self._since: datetime | None = None
        self._due = float("-inf")

    def __len__(self) -> int:
        return len(self.users) + len(self.sessions)

    def refresh(self, force: bool = False) -> bool:
        """Read what was tombstoned since the last read, when ``refresh_s`` passed (or ``force``);
        whether a session or user is new to this stage (a stage then purges what it buffers)."""
        if self._db is None or (not force and self._clock() < self._due):
            return False
        from sqlalchemy import select

        from flywheel.db.models import Erasure, ErasureSession

        started = datetime.now(UTC)
        since = None if self._since is None else self._since - OVERLAP
        users = select(Erasure.id, Erasure.tenant, Erasure.user_hash, Erasure.requested_at).where(
            Erasure.user_hash.is_not(None))
        sessions = select(ErasureSession.tenant, ErasureSession.session_id)
        if since is not None:
            users, sessions = users.where(Erasure.requested_at >= since), sessions.where(ErasureSession.added_at >= since)
        with self._db() as db:
            user_rows, session_rows = db.execute(users).all(), db.execute(sessions).all()
        before = len(self)
        for erasure_id, tenant, user_hash, requested_at in user_rows:
            known = self.users.get((tenant, user_hash))
            if known is None or known[1] < requested_at:
                self.users[(tenant, user_hash)] = (int(erasure_id), requested_at)
        self.sessions.update((tenant, session_id) for tenant, session_id in session_rows)
        self._since, self._due = started, self._clock() + self.refresh_s
        return len(self) > before

    def drops_session(self, tenant: str, session_id: str) -> bool:
        """Whether every record of this session is to be dropped."""
        return (tenant, session_id) in self.sessions

    def erasure_of(self, tenant: str, user_hash: str | None, ts: datetime) -> int | None:
        """The erasure that covers a generation of ``user_hash`` sent at ``ts`` (None: none does)."""
        if user_hash is None:
            return None
        known = self.users.get((tenant, user_hash))
        return known[0] if known is not None and ts <= known[1] else None

    def cover(self, db: Session, erasure_id: int, keys: set[Key]) -> None:
        """Tombstone ``keys`` (sessions found in flight with an erased user's generations) for
        every stage: written with ``db``'s transaction, known here at once."""
        from flywheel.db.models import ErasureSession
        from flywheel.db.session import insert_ignore

        now = datetime.now(UTC)
        insert_ignore(db, ErasureSession, [{"erasure_id": erasure_id, "tenant": tenant, "session_id": session_id,
                                            "trajectory_id": trajectory_id_for(tenant, session_id), "added_at": now}
                                           for tenant, session_id in sorted(keys)])
        self.sessions.update(keys)
