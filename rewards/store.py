"""The rewards stage's database access: spec registry, scored rows, per-version reward stats, and
the conversations the judge and the text guards read. Small functions over a caller's session; none commits.

Invariants:
- A spec version names one spec forever: :func:`register_spec` records its fingerprint the first
  time and refuses a different spec under the same version afterwards.
- Scored rows are inserted idempotently (keyed by ``event_id``, itself derived from trajectory,
  revision and spec version), and :func:`insert_scored` says which rows were really new, so stats
  are counted once however often a batch is replayed.
- ``reward_version_stats`` counts, per (model line, served version, spec version), each trajectory
  once, by its newest scored revision: when a newer revision arrives the older one's contribution
  is taken back. Counts move by SQL increments (``SET n = n + :d``, rows touched in key order), so
  several workers can update them concurrently. :func:`rebuild_stats` recomputes a spec version's
  rows from the scored rows alone, giving the same numbers.
- Anomaly flags (``rewards.guards.anomalies``) are re-evaluated for every model line a batch touched.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session, sessionmaker

from flywheel.db.models import Generation, RewardSpecRow, RewardVersionStats, ScoredTrajectoryRow, Trajectory
from flywheel.db.session import JSONText, insert_ignore
from flywheel.events import ScoredTrajectory, TrajectoryEvent
from rewards.guards import VersionStats, anomalies, served_version
from rewards.judge import transcript_of
from rewards.normalise import Normaliser
from rewards.spec import RewardSpec, SpecError

#: (model line, model version) -> [train count, train sum, held-out count, held-out sum]
Deltas = dict[tuple[str, int], list[float]]


def _now() -> datetime:
    return datetime.now(UTC)


def register_spec(db: Session, spec: RewardSpec) -> None:
    """Record ``spec`` under its version, or check that the version already names this very spec."""
    insert_ignore(db, RewardSpecRow, [{"version": spec.version, "sha256": spec.sha256,
                                       "spec": spec.model_dump(mode="json"), "created_at": _now()}])
    known = db.get(RewardSpecRow, spec.version)
    if known is not None and known.sha256 != spec.sha256:
        raise SpecError(f"reward spec version {spec.version!r} already names another spec (sha256 {known.sha256[:12]}, "
                        f"this one {spec.sha256[:12]}): give the changed spec a new version")


def scored_row(s: ScoredTrajectory, encoded: str | None = None) -> dict[str, Any]:
    """The ``scored_trajectories`` row of ``s`` (``encoded``: its JSON, when already made)."""
    return {
        "trajectory_id": s.trajectory_id,
        "revision": s.revision,
        "reward_spec_version": s.reward_spec_version,
        "event_id": s.event_id,
        "tenant": s.tenant,
        "total_reward": s.total_reward,
        "ts": s.ts,
        "payload": JSONText(s.model_dump_json() if encoded is None else encoded),
    }


def stored_payloads(db: Session, event_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The stored payloads of those of ``event_ids`` already scored."""
    ids = list(event_ids)
    if not ids:
        return {}
    rows = db.execute(select(ScoredTrajectoryRow.event_id, ScoredTrajectoryRow.payload)
                      .where(ScoredTrajectoryRow.event_id.in_(ids)))
    return {event_id: payload for event_id, payload in rows}


def insert_scored(db: Session, scored: Sequence[ScoredTrajectory], encoded: dict[str, str] | None = None) -> set[str]:
    """Insert ``scored`` (a duplicate key is skipped); returns the event ids actually inserted.
    ``encoded``: JSON of some of them by event id, already made."""
    if not scored:
        return set()
    table = ScoredTrajectoryRow.__table__
    if db.get_bind().dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    stmt = insert(table).on_conflict_do_nothing().returning(table.c.event_id)
    encoded = encoded or {}
    return {row[0] for row in db.execute(stmt, [scored_row(s, encoded.get(s.event_id)) for s in scored])}


# --- per-version stats -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Contribution:
    model_line: str
    version: int
    held_out: bool
    total: float


def contribution(payload: dict[str, Any]) -> Contribution | None:
    """What one stored scored payload adds to the stats (``None``: no turns, no version to credit)."""
    turns = [turn for segment in payload["segments"] for turn in segment["turns"]]
    if not turns:
        return None
    return Contribution(payload["model_line"], int(turns[-1]["behaviour_version"]), bool(payload.get("held_out")),
                        float(payload["total_reward"]))


def contribution_of(s: ScoredTrajectory) -> Contribution | None:
    """:func:`contribution` of a scored event (``rewards.guards.served_version``)."""
    version = served_version(s.segments)
    return None if version is None else Contribution(s.model_line, version, s.held_out, s.total_reward)


def _add(deltas: Deltas, c: Contribution | None, sign: int) -> None:
    if c is None:
        return
    d = deltas.setdefault((c.model_line, c.version), [0, 0.0, 0, 0.0])
    k = 2 if c.held_out else 0
    d[k] += sign
    d[k + 1] += sign * c.total


def stats_deltas(db: Session, spec_version: str, new: Sequence[ScoredTrajectory]) -> Deltas:
    """How the stats move when the rows ``new`` (just inserted) join the scored table: per
    trajectory, the newest revision counts (module invariants)."""
    deltas: Deltas = {}
    if not new:
        return deltas
    new_ids = {s.event_id for s in new}
    by_traj: dict[str, list[tuple[int, str]]] = defaultdict(list)
    rows = db.execute(select(ScoredTrajectoryRow.trajectory_id, ScoredTrajectoryRow.revision, ScoredTrajectoryRow.event_id)
                      .where(ScoredTrajectoryRow.trajectory_id.in_({s.trajectory_id for s in new}),
                             ScoredTrajectoryRow.reward_spec_version == spec_version))
    for trajectory_id, revision, event_id in rows:
        by_traj[trajectory_id].append((revision, event_id))
    scored_of = {s.event_id: s for s in new}
    for revisions in by_traj.values():
        after = max(revisions)
        old = [r for r in revisions if r[1] not in new_ids]
        before = max(old) if old else None
        if before == after:
            continue
        if before is not None:
            _add(deltas, contribution(stored_payloads(db, [before[1]])[before[1]]), -1)
        _add(deltas, contribution_of(scored_of[after[1]]), +1)
    return deltas


def apply_stats(db: Session, spec: RewardSpec, deltas: Deltas) -> None:
    """Move the stats rows by ``deltas`` and re-evaluate the flags of the model lines touched."""
    if not deltas:
        return
    now = _now()
    keys = sorted(deltas)
    insert_ignore(db, RewardVersionStats, [
        {"model_line": line, "model_version": version, "reward_spec_version": spec.version, "train_count": 0,
         "train_sum": 0.0, "held_out_count": 0, "held_out_sum": 0.0, "flagged": False, "flag_reason": "",
         "updated_at": now}
        for line, version in keys
    ])
    t = RewardVersionStats
    for line, version in keys:
        dn, ds, hn, hs = deltas[(line, version)]
        db.execute(update(t).where(t.model_line == line, t.model_version == version, t.reward_spec_version == spec.version)
                   .values(train_count=t.train_count + int(dn), train_sum=t.train_sum + ds,
                           held_out_count=t.held_out_count + int(hn), held_out_sum=t.held_out_sum + hs, updated_at=now))
    for line in sorted({line for line, _ in keys}):
        refresh_flags(db, spec, line)


def refresh_flags(db: Session, spec: RewardSpec, model_line: str) -> None:
    """Store the anomaly verdict of every version of ``model_line`` under ``spec``."""
    t = RewardVersionStats
    rows = db.execute(select(t).where(t.model_line == model_line, t.reward_spec_version == spec.version)).scalars().all()
    verdicts = anomalies([VersionStats(r.model_version, r.train_count, r.train_sum, r.held_out_count, r.held_out_sum)
                          for r in rows], spec.guards.anomaly)
    for r in rows:
        reason = verdicts[r.model_version]
        if r.flagged != (reason is not None) or r.flag_reason != (reason or ""):
            db.execute(update(t).where(t.model_line == model_line, t.model_version == r.model_version,
                                       t.reward_spec_version == spec.version)
                       .values(flagged=reason is not None, flag_reason=reason or "", updated_at=_now()))


def rebuild_stats(db: Session, spec: RewardSpec, chunk: int = 500) -> None:
    """Recompute every stats row of ``spec.version`` from its scored rows (newest revision each)."""
    newest: dict[str, tuple[int, int]] = {}  # trajectory_id -> (revision, row id)
    for trajectory_id, revision, row_id in db.execute(
        select(ScoredTrajectoryRow.trajectory_id, ScoredTrajectoryRow.revision, ScoredTrajectoryRow.id)
        .where(ScoredTrajectoryRow.reward_spec_version == spec.version)
    ):
        if trajectory_id not in newest or revision > newest[trajectory_id][0]:
            newest[trajectory_id] = (revision, row_id)
    deltas: Deltas = {}
    ids = sorted(row_id for _, row_id in newest.values())
    for start in range(0, len(ids), chunk):
        chosen = ScoredTrajectoryRow.id.in_(ids[start : start + chunk])
        for payload in db.scalars(select(ScoredTrajectoryRow.payload).where(chosen)):
            _add(deltas, contribution(payload), +1)
    db.execute(delete(RewardVersionStats).where(RewardVersionStats.reward_spec_version == spec.version))
    apply_stats(db, spec, deltas)


def stats_rows(db: Session, spec_version: str | None = None) -> list[RewardVersionStats]:
    t = RewardVersionStats
    query = select(t).order_by(t.reward_spec_version, t.model_line, t.model_version)
    if spec_version:
        query = query.where(t.reward_spec_version == spec_version)
    return list(db.execute(query).scalars())


# --- normalisation state ---------------------------------------------------------------------------


def stored_trajectories(db: Session, event_ids: Iterable[str]) -> set[str]:
    """Which of these trajectory events ingest stored (its outbox stores each before producing it)."""
    wanted = sorted(set(event_ids))
    return set(db.scalars(select(Trajectory.event_id).where(Trajectory.event_id.in_(wanted)))) if wanted else set()


def restore_normaliser(db: Session, normaliser: Normaliser, spec_version: str, rows: int) -> int:
    """Replay the newest ``rows`` scored, non-held-out rows of ``spec_version`` (oldest first) into
    ``normaliser``; returns how many were replayed."""
    if rows <= 0:
        return 0
    payloads = db.scalars(select(ScoredTrajectoryRow.payload)
                          .where(ScoredTrajectoryRow.reward_spec_version == spec_version)
                          .order_by(ScoredTrajectoryRow.id.desc()).limit(rows)).all()
    replayed = 0
    for p in reversed(payloads):
        if not p.get("held_out"):
            normaliser.observe(p["tenant"], p["model_line"], p.get("prompt_key"), p["turn_rewards"])
            replayed += 1
    return replayed


# --- the conversations the judge and the text guards read --------------------------------------------


class DbGenerations:
    """``trajectory -> {generation_id: payload}``: its stored generations, of its own tenant only
    (``rewards.texts.Generations``)."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self.sessions = sessions

    def __call__(self, traj: TrajectoryEvent) -> dict[str, dict[str, Any]]:
        if not traj.generation_ids:
            return {}
        with self.sessions() as db:
            return dict(db.execute(select(Generation.generation_id, Generation.payload)
                                   .where(Generation.generation_id.in_(traj.generation_ids),
                                          Generation.tenant == traj.tenant)).all())


class DbTranscripts:
    """``trajectory -> conversation`` from the stored generations (``rewards.judge.transcript_of``)."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self.generations = DbGenerations(sessions)

    def __call__(self, traj: TrajectoryEvent) -> list[dict[str, Any]]:
        found = self.generations(traj)
        return transcript_of([found[g] for g in traj.generation_ids if g in found])
