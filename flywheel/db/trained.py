"""Which version each trajectory was trained into: the rows a publish records, and their look-ups.

A published version's ``metrics["trajectory_ids"]`` lists the trajectories trained into it; the
registry records them in ``trained_trajectories`` (:class:`.models.TrainedTrajectory`) in the same
transaction that inserts the version's row, so the table and the metrics never disagree about a
committed version.

Invariants: a trajectory id has at most one row, and recording one again (a replayed publish, a
trainer that broke the at-most-once rule) is a no-op: the first version keeps it. Nothing here
commits; the caller owns the transaction.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from flywheel.db.models import TrainedTrajectory
from flywheel.db.session import insert_ignore

#: The ``metrics`` key that lists a version's trajectories.
METRICS_KEY = "trajectory_ids"
#: The longest trajectory id the table (and ``trajectories.trajectory_id``) holds.
MAX_ID_LENGTH = 128


def trained_ids(metrics: Mapping[str, Any] | None) -> list[str]:
    """The trajectory ids ``metrics`` lists (none when the key is absent); :class:`ValueError`
    unless they are a list of non-empty strings of at most :data:`MAX_ID_LENGTH` characters."""
    ids = (metrics or {}).get(METRICS_KEY)
    if ids is None:
        return []
    if not isinstance(ids, list | tuple) or not all(isinstance(i, str) and 0 < len(i) <= MAX_ID_LENGTH for i in ids):
        raise ValueError(f"metrics[{METRICS_KEY!r}] must be a list of trajectory ids "
                         f"(strings of 1 to {MAX_ID_LENGTH} characters)")
    return list(ids)


def record_trained(session: Session, model_line: str, version: int, ids: Iterable[str], at: datetime) -> int:
    """Record ``ids`` as trained into ``version`` of ``model_line`` (insert or ignore); returns how
    many were new. Does not commit."""
    rows = {tid: {"trajectory_id": tid, "model_line": model_line, "version": version, "trained_at": at}
            for tid in ids}
    return insert_ignore(session, TrainedTrajectory, rows.values())


def trained_into(session: Session, ids: Iterable[str]) -> dict[str, tuple[str, int]]:
    """``(model line, version)`` each of ``ids`` was trained into; ids never trained are left out."""
    wanted = list(dict.fromkeys(ids))
    out: dict[str, tuple[str, int]] = {}
    for start in range(0, len(wanted), 500):  # bound the IN list
        query = select(TrainedTrajectory).where(TrainedTrajectory.trajectory_id.in_(wanted[start : start + 500]))
        out.update({r.trajectory_id: (r.model_line, r.version) for r in session.scalars(query)})
    return out


def trained_in(session: Session, model_line: str, version: int, limit: int | None = None) -> list[str]:
    """The trajectory ids trained into ``version`` of ``model_line``, sorted (the first ``limit``)."""
    query = (select(TrainedTrajectory.trajectory_id)
             .where(TrainedTrajectory.model_line == model_line, TrainedTrajectory.version == version)
             .order_by(TrainedTrajectory.trajectory_id).limit(limit))
    return list(session.scalars(query))


def trained_count(session: Session, model_line: str, version: int) -> int:
    """How many trajectories were trained into ``version`` of ``model_line``."""
    query = select(func.count()).select_from(TrainedTrajectory).where(
        TrainedTrajectory.model_line == model_line, TrainedTrajectory.version == version)
    return int(session.scalar(query) or 0)
