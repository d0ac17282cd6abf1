"""What the console reads from the database: one function per question a page asks, each on an index.

Every query here is bounded (a page of rows, a ``LIMIT``, a key) and runs on an index declared in
``flywheel/db/models.py`` (``tests/integration/test_console_scale.py`` EXPLAINs each one on
PostgreSQL with 1,000 versions and 100,000 sessions). Payload JSON is read only for the rows a page
shows. Functions take an open SQLAlchemy session and return plain dicts and dataclasses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import and_, func, select
from sqlalchemy.orm import Session

from flywheel.db import trained
from flywheel.db.models import (
    ApiKey,
    Feedback,
    Generation,
    ModelVersion,
    RewardSpecRow,
    RewardVersionStats,
    ScoredTrajectoryRow,
    SessionState,
    Trajectory,
    VersionTransition,
)
from flywheel.db.observed import OBSERVABLE, observe, reported
from flywheel.metrics import Metrics
from serving.rollout_policy import NEGATIVE_SIGNALS

#: Versions a page of the lineage shows.
PAGE = 50


@dataclass(frozen=True)
class VersionRow:
    """One version as the lineage shows it (the metrics JSON is read for these rows only)."""

    version: int
    kind: str
    parent: int | None
    status: str
    bytes: int
    full_bytes: int
    fraction_changed: float | None
    train_step: int | None
    created_at: datetime
    pinned: bool
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def pct_of_full(self) -> float | None:
        return 100.0 * self.bytes / self.full_bytes if self.full_bytes else None


_VERSION_COLUMNS = (ModelVersion.version, ModelVersion.kind, ModelVersion.parent, ModelVersion.status,
                    ModelVersion.bytes, ModelVersion.full_bytes, ModelVersion.fraction_changed,
                    ModelVersion.train_step, ModelVersion.created_at, ModelVersion.pinned_at)


def _version_row(r: Any, metrics: dict[str, Any] | None) -> VersionRow:
    return VersionRow(r.version, r.kind, r.parent, r.status, int(r.bytes), int(r.full_bytes), r.fraction_changed,
                      r.train_step, r.created_at, r.pinned_at is not None, metrics or {})


def serving_versions(db: Session, line: str) -> list[VersionRow]:
    """The line's stable and canary versions (``ix_model_versions_status``)."""
    rows = db.execute(select(*_VERSION_COLUMNS, ModelVersion.metrics)
                      .where(ModelVersion.model_line == line, ModelVersion.status.in_(("stable", "canary")))
                      .order_by(ModelVersion.version.desc()))
    return [_version_row(r, _slim(r.metrics)) for r in rows]


def recent_versions(db: Session, line: str, limit: int = 10, before: int | None = None) -> list[VersionRow]:
    """The newest ``limit`` versions of the line (below ``before``), newest first (primary key)."""
    query = select(*_VERSION_COLUMNS, ModelVersion.metrics).where(ModelVersion.model_line == line)
    if before is not None:
        query = query.where(ModelVersion.version < before)
    rows = db.execute(query.order_by(ModelVersion.version.desc()).limit(limit))
    return [_version_row(r, _slim(r.metrics)) for r in rows]


def one_version(db: Session, line: str, version: int) -> VersionRow | None:
    r = db.execute(select(*_VERSION_COLUMNS, ModelVersion.metrics)
                   .where(ModelVersion.model_line == line, ModelVersion.version == version)).first()
    return None if r is None else _version_row(r, _slim(r.metrics))


def newest_version(db: Session, line: str) -> tuple[int, datetime] | None:
    """The line's highest version number and when it was published (a backward scan of the
    primary key, one row)."""
    row = db.execute(select(ModelVersion.version, ModelVersion.created_at).where(ModelVersion.model_line == line)
                     .order_by(ModelVersion.version.desc()).limit(1)).first()
    return None if row is None else (row.version, row.created_at)


def _slim(metrics: dict[str, Any] | None) -> dict[str, Any]:
    """A version's metrics without the (long) list of the trajectories it trained on."""
    if not metrics:
        return {}
    out = {k: v for k, v in metrics.items() if k != "trajectory_ids"}
    out["trajectories"] = len(metrics.get("trajectory_ids") or ())
    return out


def transitions(db: Session, line: str, versions: Sequence[int]) -> dict[int, list[dict[str, Any]]]:
    """The audit log of ``versions``, oldest first (``ix_version_transitions_version``)."""
    out: dict[int, list[dict[str, Any]]] = {v: [] for v in versions}
    if not versions:
        return out
    rows = db.execute(select(VersionTransition.version, VersionTransition.from_status, VersionTransition.to_status,
                             VersionTransition.reason, VersionTransition.at)
                      .where(VersionTransition.model_line == line, VersionTransition.version.in_(list(versions)))
                      .order_by(VersionTransition.id))
    for r in rows:
        out[r.version].append({"from": r.from_status, "to": r.to_status, "reason": r.reason, "at": r.at})
    return out


def latest_spec(db: Session) -> str | None:
    """The newest reward spec version (a handful of rows)."""
    return db.scalar(select(RewardSpecRow.version).order_by(RewardSpecRow.created_at.desc()).limit(1))


def rewards(db: Session, line: str, spec: str | None, lo: int | None = None, hi: int | None = None
            ) -> dict[int, dict[str, Any]]:
    """Per version: mean training and held-out reward under ``spec`` (primary key of the stats)."""
    if spec is None:
        return {}
    query = select(RewardVersionStats).where(RewardVersionStats.model_line == line,
                                             RewardVersionStats.reward_spec_version == spec)
    if lo is not None and hi is not None:
        query = query.where(RewardVersionStats.model_version.between(lo, hi))
    out = {}
    for s in db.scalars(query):
        out[s.model_version] = {
            "train": s.train_sum / s.train_count if s.train_count else None, "train_n": s.train_count,
            "held_out": s.held_out_sum / s.held_out_count if s.held_out_count else None, "held_out_n": s.held_out_count,
            "flagged": s.flagged, "flag_reason": s.flag_reason}
    return out


def served_counts(db: Session, line: str, lo: int, hi: int) -> dict[int, dict[str, int]]:
    """Per version in ``[lo, hi]``: generations served and feedback events on them
    (``ix_generations_version``, then ``ix_feedback_generation``)."""
    negative = ((Feedback.signal == "thumbs") & (Feedback.value < 0)) | Feedback.signal.in_(NEGATIVE_SIGNALS)
    mine = and_(Feedback.generation_id == Generation.generation_id, Feedback.tenant == Generation.tenant)
    # Per generation, its feedback counted on ix_feedback_generation (a join would hash all feedback).
    per_generation = (select(Generation.model_version.label("version"),
                             select(func.count()).where(mine).scalar_subquery().label("all"),
                             select(func.count()).where(mine, negative).scalar_subquery().label("negative"))
                      .where(Generation.model_line == line, Generation.model_version.between(lo, hi)).subquery())
    rows = db.execute(select(per_generation.c.version, func.count(), func.sum(per_generation.c.all),
                             func.sum(per_generation.c.negative)).group_by(per_generation.c.version))
    return {v: {"generations": int(g), "feedback": int(n or 0), "negative": int(neg or 0)} for v, g, n, neg in rows}


def observed(db: Session, metrics: Metrics, line: str, version: int) -> list[dict[str, Any]]:
    """What ``version`` observed of each boolean and float product metric over all time, as the
    promotion gates observe it (flywheel/db/observed.py, on ``ix_generations_version``, then
    ``ix_feedback_generation`` or ``ix_feedback_session``): each metric some feedback in its sessions
    reports (:func:`~flywheel.db.observed.reported`; the others would be a row of zeros or nothing, and observing a metric
    nobody reports can cost a scan of all feedback), with its sessions and their mean."""
    candidates = [m for m in metrics if m.declaration.type in OBSERVABLE]
    names = reported(db, [m.name for m in candidates], line, [version])
    out = []
    for metric in (m for m in candidates if m.name in names):
        o = observe(db, metric, line, [version])[version]
        if o.n:
            d = metric.declaration
            out.append({"metric": metric.name, "type": d.type, "level": d.level, "direction": d.direction,
                        "sessions": o.n, "mean": o.mean})
    return out


def trained_in(db: Session, line: str, version: int, limit: int = 100) -> list[dict[str, Any]]:
    """Trajectories trained into ``version``, with their session (``ix_trained_trajectories_version``,
    then ``uq_trajectory_revision``'s prefix)."""
    ids = trained.trained_in(db, line, version, limit)
    if not ids:
        return []
    where = {r.trajectory_id: (r.tenant, r.session_id) for r in db.execute(
        select(Trajectory.trajectory_id, Trajectory.tenant, Trajectory.session_id)
        .where(Trajectory.trajectory_id.in_(ids)))}
    return [{"trajectory_id": t, "tenant": where.get(t, (None, None))[0], "session_id": where.get(t, (None, None))[1]}
            for t in ids]


# -- sessions -------------------------------------------------------------------------------------


def tenants(db: Session, default: str) -> list[str]:
    """The tenants to browse: those with API keys, and the default tenant (``ix_api_keys_tenant``)."""
    names = set(db.scalars(select(ApiKey.tenant).distinct()).all())
    return sorted(names | {default})


def recent_sessions(db: Session, tenant: str, limit: int = 50, before: datetime | None = None) -> list[dict[str, Any]]:
    """A tenant's sessions, most recently active first (``ix_sessions_tenant_recent``)."""
    query = select(SessionState.tenant, SessionState.session_id, SessionState.status, SessionState.last_event_at,
                   SessionState.revision).where(SessionState.tenant == tenant)
    if before is not None:
        query = query.where(SessionState.last_event_at < before)
    rows = db.execute(query.order_by(SessionState.last_event_at.desc()).limit(limit))
    return [dict(r._mapping) for r in rows]


def find_sessions(db: Session, session_id: str, limit: int = 20) -> list[dict[str, Any]]:
    """Every tenant's session named ``session_id`` (``ix_sessions_session_id``)."""
    rows = db.execute(select(SessionState.tenant, SessionState.session_id, SessionState.status,
                             SessionState.last_event_at, SessionState.revision)
                      .where(SessionState.session_id == session_id).limit(limit))
    return [dict(r._mapping) for r in rows]


@dataclass
class SessionStory:
    """Everything recorded of one session: its turns, feedback, trajectories, scores, training."""

    tenant: str
    session_id: str
    state: dict[str, Any] | None
    turns: list[dict[str, Any]]
    feedback: list[dict[str, Any]]
    trajectories: list[dict[str, Any]]


def session_story(db: Session, tenant: str, session_id: str, limit: int = 200) -> SessionStory:
    """One session, read on the (tenant, session id) indexes of each table; scores and training by
    trajectory id (``uq_scored_revision_spec``'s prefix, ``trained_trajectories``' key)."""
    state = db.execute(select(SessionState.status, SessionState.last_event_at, SessionState.closed_at,
                              SessionState.revision)
                       .where(SessionState.tenant == tenant, SessionState.session_id == session_id)).first()
    turns = [_turn(g) for g in db.execute(
        select(Generation.generation_id, Generation.model_version, Generation.node_id, Generation.ts, Generation.payload)
        .where(Generation.tenant == tenant, Generation.session_id == session_id)
        .order_by(Generation.ts).limit(limit))]
    feedback = [{"generation_id": f.generation_id, "kind": f.kind, "signal": f.signal, "value": f.value, "ts": f.ts,
                 "state": f.state, "comment": (f.payload or {}).get("comment")}
                for f in db.execute(select(Feedback.generation_id, Feedback.kind, Feedback.signal, Feedback.value,
                                           Feedback.ts, Feedback.state, Feedback.payload)
                                    .where(Feedback.tenant == tenant, Feedback.session_id == session_id)
                                    .order_by(Feedback.ts).limit(limit))]
    trajs = db.execute(select(Trajectory.trajectory_id, Trajectory.revision, Trajectory.closed_reason, Trajectory.ts)
                       .where(Trajectory.tenant == tenant, Trajectory.session_id == session_id)
                       .order_by(Trajectory.ts).limit(limit)).all()
    ids = sorted({t.trajectory_id for t in trajs})
    scored: dict[tuple[str, int], list[dict[str, Any]]] = {}
    trained_into: dict[str, int] = {}
    if ids:
        for s in db.execute(select(ScoredTrajectoryRow.trajectory_id, ScoredTrajectoryRow.revision,
                                   ScoredTrajectoryRow.reward_spec_version, ScoredTrajectoryRow.total_reward,
                                   ScoredTrajectoryRow.payload)
                            .where(ScoredTrajectoryRow.trajectory_id.in_(ids))):
            p = s.payload or {}
            scored.setdefault((s.trajectory_id, s.revision), []).append({
                "spec": s.reward_spec_version, "total": s.total_reward, "turn_rewards": p.get("turn_rewards") or [],
                "components": p.get("reward_components") or {}, "held_out": bool(p.get("held_out")),
                "turn_ids": [t.get("generation_id") for seg in p.get("segments") or () for t in seg.get("turns") or ()],
                "advantages": p.get("turn_advantages")})
        trained_into = {t: v for t, (_, v) in trained.trained_into(db, ids).items()}
    trajectories = [{"trajectory_id": t.trajectory_id, "revision": t.revision, "closed_reason": t.closed_reason,
                     "ts": t.ts, "scores": scored.get((t.trajectory_id, t.revision), []),
                     "trained_in": trained_into.get(t.trajectory_id)} for t in trajs]
    return SessionStory(tenant, session_id, None if state is None else dict(state._mapping), turns, feedback,
                        trajectories)


def _turn(g: Any) -> dict[str, Any]:
    """A served turn: the last user message of the request and the answer, as text."""
    p = g.payload or {}
    request, response = p.get("request") or {}, p.get("response") or {}
    messages = request.get("messages") or []
    prompt = next((m.get("content") for m in reversed(messages) if isinstance(m, dict) and m.get("role") == "user"),
                  request.get("prompt"))
    choices = response.get("choices") or [{}]
    choice = choices[0] if isinstance(choices[0], dict) else {}
    answer = (choice.get("message") or {}).get("content") if "message" in choice else choice.get("text")
    return {"generation_id": g.generation_id, "version": g.model_version, "node": g.node_id, "ts": g.ts,
            "prompt": _text(prompt), "answer": _text(answer), "finish_reason": p.get("finish_reason"),
            "latency_ms": p.get("latency_ms"), "tokens": len(p.get("completion_token_ids") or ())}


def _text(value: Any) -> str:
    """Message content as text (a list of parts joins its text parts)."""
    if value is None:
        return ""
    if isinstance(value, list):
        return "\n".join(str(part.get("text", "")) for part in value if isinstance(part, dict))
    return str(value)


def open_sessions(db: Session) -> int:
    """Sessions ingest holds open (``ix_sessions_status``)."""
    return int(db.scalar(select(func.count()).select_from(SessionState).where(SessionState.status == "open")) or 0)
