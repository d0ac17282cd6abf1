"""Forgotten subjects, pure: the sessions an erasure covers, and the check that they leave no trace.

:class:`Forgotten` is what :func:`chaos.collect.collect` reads once the run drained: every
``erasures`` row, every ``erasure_sessions`` row (the tombstoned sessions, :func:`sessions_of`), the
``trained_trajectories`` rows still naming those sessions' trajectories, the records of those
sessions on the ``trajectories`` and ``scored`` topics (keyed by session id), and the subjects a
fault erased (:class:`ForgetSubject`: what that end user sent before the request, and after it
completed). :func:`check_no_trace` is the invariant ``forgotten_leave_no_trace``:

- every erasure is ``done`` and says what it deleted (a subject with sessions deleted rows);
- nothing stored of a tombstoned session: no generation, feedback, session, trajectory, scored or
  trained row (and no generation of an erased user sent at or before the request);
- every session the subject was served in before the request is tombstoned; none it began after
  the erasure completed is (those are new data: the other invariants check them whole);
- no record of a tombstoned session was produced on ``trajectories`` or ``scored`` after the
  erasure completed (or :data:`GRACE` after a stage tombstoned the session later);
- every version that trained on one of those sessions is in the erasure's ``trained_into``, and
  of the versions published after it completed only the first (a step already under way) may hold one.

The other invariants are checked without the tombstoned sessions' client-side items
(:func:`chaos.invariants.without_forgotten`): their rows are gone by design.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from flywheel.events import trajectory_id_for

#: How long after a session is tombstoned a stage may still produce a record of it: it reads the
#: tombstones every second (flywheel.tombstones.REFRESH_S) and finishes the batch in hand.
GRACE = timedelta(seconds=3)


@dataclass(frozen=True)
class ErasureRow:
    id: int
    tenant: str
    user_hash: str | None
    session_id: str | None
    state: str
    requested_at: datetime
    completed_at: datetime | None
    counts: dict[str, int]
    trained_into: tuple[int, ...]  # the versions (of any line) the erasure names


@dataclass(frozen=True)
class ForgetSubject:
    """An end user a fault erased: the sessions it was served in before the request (each must be
    tombstoned) and those it began after the erasure completed (none may be)."""

    tenant: str
    user_hash: str
    before: tuple[str, ...]
    after: tuple[str, ...]


@dataclass(frozen=True)
class TopicRecord:
    """A record of a tombstoned session on ``trajectories`` or ``scored`` (by its key, the session id)."""

    topic: str
    session_id: str
    where: str  # ``scored[2]@153``
    ts: datetime  # when it was produced (the record's timestamp)


@dataclass
class Forgotten:
    erasures: list[ErasureRow] = field(default_factory=list)
    #: (tenant, session id) -> (the erasure that covers it, when it was tombstoned)
    sessions: dict[tuple[str, str], tuple[int, datetime]] = field(default_factory=dict)
    trained: dict[str, int] = field(default_factory=dict)  # trained_trajectories rows of those sessions
    records: list[TopicRecord] = field(default_factory=list)
    subjects: list[ForgetSubject] = field(default_factory=list)


def sessions_of(f: Forgotten) -> set[str]:
    """The ids of the tombstoned sessions."""
    return {sid for _, sid in f.sessions}


def trajectory_ids_of(f: Forgotten) -> dict[str, str]:
    """trajectory id -> session id, for every tombstoned session."""
    return {trajectory_id_for(tenant, sid): sid for tenant, sid in f.sessions}


def check_no_trace(f: Forgotten, generations: list[Any], feedback: list[Any], session_status: dict[str, Any],
                   trajectories: list[Any], scored: list[Any], versions: list[Any]) -> tuple[bool, str]:
    """The invariant (module docstring) over the snapshot's rows: (ok, detail)."""
    if not f.erasures:
        return True, "no erasure requested"
    gone = sessions_of(f)
    ids = trajectory_ids_of(f)
    by_id = {e.id: e for e in f.erasures}
    unfinished = [f"erasure {e.id}: {e.state}" for e in f.erasures
                  if e.state != "done" or e.completed_at is None or (e.user_hash and not sum(e.counts.values()))]
    users = {(e.tenant, e.user_hash): e.requested_at for e in f.erasures if e.user_hash}
    left = {
        "generations": sum(1 for g in generations if g.session_id in gone or (
            (tenant := g.payload.get("tenant"), g.payload.get("user_hash")) in users
            and g.ts is not None and g.ts <= users[(tenant, g.payload.get("user_hash"))])),
        "feedback": sum(1 for r in feedback if r.session_id in gone),
        "sessions": sum(1 for sid in session_status if sid in gone),
        "trajectories": sum(1 for t in trajectories if t.session_id in gone),
        "scored": sum(1 for r in scored if r.trajectory_id in ids),
        "trained": len(f.trained),
    }
    left = {k: v for k, v in left.items() if v}
    missed = [sid for s in f.subjects for sid in s.before if (s.tenant, sid) not in f.sessions]
    kept_wrongly = [sid for s in f.subjects for sid in s.after if (s.tenant, sid) in f.sessions]
    late = []
    for r in f.records:
        key = next(k for k in f.sessions if k[1] == r.session_id)
        erasure_id, added = f.sessions[key]
        done = by_id[erasure_id].completed_at if erasure_id in by_id else None
        if done is not None and r.ts > max(done, added + GRACE):
            late.append(f"{r.where} at {r.ts:%H:%M:%S.%f}"[:-3])
    holding = {v.version: {ids[t] for t in v.trajectory_ids if t in ids} for v in versions}
    holding = {v: sids for v, sids in holding.items() if sids}
    unnamed, after_done = [], []
    for e in f.erasures:
        mine = {sid for (tenant, sid), (eid, _) in f.sessions.items() if eid == e.id}
        held = sorted(v for v, sids in holding.items() if sids & mine)
        unnamed += [v for v in held if v not in e.trained_into]
        if e.completed_at is not None:
            later = sorted((v for v in versions if v.created_at is not None and v.created_at > e.completed_at),
                           key=lambda v: v.version)
            after_done += [v.version for v in later[1:] if v.version in held]
    ok = not (unfinished or left or missed or kept_wrongly or late or unnamed or after_done)
    erasures = "; ".join(f"erasure {e.id} {e.state}: deleted {e.counts}, trained_into {list(e.trained_into)}"
                         for e in f.erasures)
    detail = (f"{erasures}; {len(gone)} sessions tombstoned; rows left {left or 'none'}; unfinished {unfinished or 'none'}; "
              f"sessions served before the request not tombstoned {missed or 'none'}; new sessions tombstoned "
              f"{kept_wrongly or 'none'}; {len(f.records)} records of them on the topics, {len(late)} produced after "
              f"completion {late[:4]}; versions trained on them {sorted(holding) or 'none'} (not in trained_into "
              f"{unnamed or 'none'}, published after completion but the first {after_done or 'none'})")
    return ok, detail
