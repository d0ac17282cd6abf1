"""What each version observed of each product metric: per-session values from feedback joined to generations.

The unit is the **session**: the gateway assigns a session to a version and keeps it there (sticky),
so the session is what is randomised between a canary and stable, and the generations of one session
are not independent (a user who liked the first answer tends to like the next). Counting
generations as independent observations would understate the variance, and a sequential test read
every tick would promote on noise (serving/rollout_evidence.py, "Plug-in variance"). So every
metric becomes one value per session that a version served (a session with a generation of the
version in the window), and a version's observation is the count, sum and sum of squares of those
values:

- a **generation**-level metric is first one value per generation: a ``boolean`` is 1 when the
  generation has a true report of it (below) and 0 otherwise, reported or not (the rate of answers
  the users marked; a boolean that nobody reports on an answer did not happen there); a ``float`` is
  the mean of its reports, and a generation without any has no value. The session's value is the
  mean over its generations that have one: the share of its answers marked, or its mean report;
- a **session**-level metric is one value per session directly: a ``boolean`` 1 when the session
  has a true report of it, else 0 (every session served counts); a ``float`` the mean of the
  session's reports (sessions without any have no value).

A report is a ``feedback`` row whose ``signal`` is the metric's name, matched to the generation
(``generation_id`` and tenant) or the session (tenant and ``session_id``). A boolean report is true
when its value is missing or above 0 (declared booleans are recorded as 1.0 or 0.0,
flywheel/metrics.py); a built-in boolean event (``edit_rejected``, ``retry``, ...) is true whatever
its value, as the reward builders count it. Sessions without a value are left out of a ``float``
metric, so a float's observation depends on who chose to report: compare arms that are randomised
alike (a canary and stable over the same window), not populations.

Invariants: reads only; one query per metric and window for any number of versions; the
aggregation runs in the database (the same SQL on SQLite and PostgreSQL), on the
``ix_generations_version``, ``ix_feedback_generation`` and ``ix_feedback_session`` indexes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Float, and_, case, cast, func, or_, select

from flywheel.db.models import Feedback, Generation
from flywheel.metrics import Metric

#: The metric types a version can be observed on (a comment has no value).
OBSERVABLE = ("boolean", "float")


@dataclass(frozen=True)
class Observed:
    """One version's sessions' values of one metric: how many, their sum and their sum of squares."""

    n: int
    total: float
    total_sq: float

    @property
    def mean(self) -> float | None:
        return self.total / self.n if self.n else None


NOTHING = Observed(0, 0.0, 0.0)


def _report_value(metric: Metric) -> Any:
    """A feedback row's value as the metric counts it (NULL where the outer join found no row)."""
    if metric.declaration.type == "float":
        return Feedback.value
    true = Feedback.event_id.is_not(None)
    if not metric.builtin:
        true = and_(true, or_(Feedback.value.is_(None), Feedback.value > 0))
    return case((true, 1.0), else_=0.0)


def reported(db: Any, names: Sequence[str], model_line: str, versions: Sequence[int]) -> set[str]:
    """Which of ``names`` some feedback in a session that ``versions`` served names (a metric nobody
    reports is a row of zeros or nothing, so reports skip it): the sessions on
    ``ix_generations_version``, then per session one count per name on ``ix_feedback_session`` (a
    join would hash all feedback)."""
    if not names or not versions:
        return set()
    served = (select(Generation.tenant, Generation.session_id)
              .where(Generation.model_line == model_line, Generation.model_version.in_(list(versions)))
              .distinct().subquery())
    mine = and_(Feedback.tenant == served.c.tenant, Feedback.session_id == served.c.session_id)
    counts = (select(*(select(func.count()).where(mine, Feedback.signal == name).scalar_subquery().label(f"n{i}")
                       for i, name in enumerate(names)))
              .select_from(served).subquery())
    totals = db.execute(select(*(func.sum(column) for column in counts.c))).one()
    return {name for name, total in zip(names, totals) if total}


def observe(db: Any, metric: Metric, model_line: str, versions: Sequence[int], since: datetime | None = None,
            until: datetime | None = None) -> dict[int, Observed]:
    """Each of ``versions``' observation of ``metric`` over the sessions it served between ``since``
    and ``until`` (module docstring); a version that served no session with a value is :data:`NOTHING`."""
    if metric.declaration.type not in OBSERVABLE:
        raise ValueError(f"metric {metric.name!r} is a {metric.declaration.type}: it has no value to observe")
    served = [Generation.model_line == model_line, Generation.model_version.in_(list(versions))]
    if since is not None:
        served.append(Generation.ts >= since)
    if until is not None:
        served.append(Generation.ts < until)
    named = Feedback.signal == metric.name
    aggregate = func.max if metric.declaration.type == "boolean" else func.avg
    if metric.declaration.level == "generation":
        per_unit = (
            select(Generation.model_version.label("version"), Generation.tenant.label("tenant"),
                   Generation.session_id.label("session_id"),
                   cast(aggregate(_report_value(metric)), Float).label("value"))
            .outerjoin(Feedback, and_(Feedback.generation_id == Generation.generation_id,
                                      Feedback.tenant == Generation.tenant, named))
            .where(*served)
            .group_by(Generation.model_version, Generation.tenant, Generation.session_id, Generation.generation_id)
            .subquery())
        per_session = (select(per_unit.c.version, cast(func.avg(per_unit.c.value), Float).label("value"))
                       .group_by(per_unit.c.version, per_unit.c.tenant, per_unit.c.session_id).subquery())
    else:
        sessions = (select(Generation.model_version.label("version"), Generation.tenant.label("tenant"),
                           Generation.session_id.label("session_id"))
                    .where(*served).distinct().subquery())
        per_session = (
            select(sessions.c.version, cast(aggregate(_report_value(metric)), Float).label("value"))
            .select_from(sessions)
            .outerjoin(Feedback, and_(Feedback.tenant == sessions.c.tenant,
                                      Feedback.session_id == sessions.c.session_id, named))
            .group_by(sessions.c.version, sessions.c.tenant, sessions.c.session_id)
            .subquery())
    value = per_session.c.value
    rows = db.execute(select(per_session.c.version, func.count(value), func.sum(value), func.sum(value * value))
                      .where(value.is_not(None)).group_by(per_session.c.version))
    found = {int(v): Observed(int(n), float(s or 0.0), float(sq or 0.0)) for v, n, s, sq in rows}
    return {v: found.get(v, NOTHING) for v in versions}
