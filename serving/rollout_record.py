"""The rollout controller's last decision per model line, recorded each tick for the console to read.

:func:`record` upserts one row per line (``rollout_decisions``) after every tick of the rollout role:
what it decided, about which version, why, and the figures behind it (the canary's tests and
sample counts). :func:`last_decision` reads it back by primary key, so a page shows the
controller's own view without re-running its queries. Recording never fails a tick: a database
error is logged and the next tick writes again.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError

from flywheel.db.models import RolloutDecisionRow

log = logging.getLogger(__name__)


def record(sessions: Any, model_line: str, decision: Any, at: datetime | None = None) -> None:
    """Store ``decision`` (a :class:`serving.rollout.Decision`) as the line's latest."""
    at = at or datetime.now(UTC)
    figures = json.loads(json.dumps(asdict(decision).get("figures") or {}, default=str))
    try:
        with sessions() as db, db.begin():
            row = db.get(RolloutDecisionRow, model_line)
            if row is None:
                row = RolloutDecisionRow(model_line=model_line)
                db.add(row)
            row.action, row.version, row.reason = decision.action, decision.version, decision.reason[:10_000]
            row.figures, row.decided_at = figures, at
    except SQLAlchemyError as exc:
        log.warning("rollout: decision not recorded for the console: %s", type(exc).__name__)


def last_decision(db: Any, model_line: str) -> dict[str, Any] | None:
    """The line's latest recorded decision: ``{action, version, reason, figures, at}``, or None."""
    row = db.execute(select(RolloutDecisionRow).where(RolloutDecisionRow.model_line == model_line)).scalar_one_or_none()
    if row is None:
        return None
    return {"action": row.action, "version": row.version, "reason": row.reason, "figures": row.figures or {},
            "at": row.decided_at}
