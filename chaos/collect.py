"""After the traffic: settle, converge, rescore, and read everything into a :class:`Snapshot`.

:func:`settle` waits until the system caught up (the spool drained, everything received stored,
every session closed, every trajectory scored); :func:`converge_nodes` lets the nodes reach the
stable version; :func:`rescore` runs ``flywheel rewards rescore`` under a copy of the live spec;
:func:`collect` reads the database, the node logs, the node watcher and every dead-letter topic
(:func:`dead_letters`; where a poison record has no dead letter, :func:`find_poison` looks for it
on its own topic) and the erasures with what is left of their subjects (:func:`read_forgotten`).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from datetime import UTC, datetime
from typing import Any

import httpx

from chaos.diagnose import read_topic
from chaos.fleet import NODES, Fleet, NodeWatcher, node_logs
from chaos.forgotten import ErasureRow, ForgetSubject, Forgotten, TopicRecord, trajectory_ids_of
from chaos.invariants import (
    DeadLetter,
    Expectation,
    FeedbackRow,
    GenRow,
    PoisonRecord,
    ScoredRow,
    Snapshot,
    TrajectoryRow,
    VersionRow,
)
from chaos.poison import HEADER, POISON_TENANT, TOPICS
from chaos.users import Users
from flywheel.settings import Settings
from testbed.procs import wait_for

log = logging.getLogger("flywheel.chaos")


def _counts(engine: Any, spec: str | None) -> dict[str, int]:
    from sqlalchemy import and_, func, not_, select

    from flywheel.db.models import Feedback, Generation, ScoredTrajectoryRow, SessionState, Trajectory

    # A session only poison named (feedback for a session no one served) ends ``empty``, not closed.
    poisoned = and_(SessionState.tenant == POISON_TENANT, SessionState.status == "empty")
    # Scores of stored revisions only: a stray score (of a trajectory ingest never stored) is
    # ``scores_reproducible``'s to flag, not a reason to wait.
    of_stored = and_(Trajectory.trajectory_id == ScoredTrajectoryRow.trajectory_id,
                     Trajectory.revision == ScoredTrajectoryRow.revision)
    with engine.connect() as conn:
        def n(stmt: Any) -> int:
            return int(conn.scalar(stmt) or 0)

        return {
            "generations": n(select(func.count()).select_from(Generation)),
            "feedback": n(select(func.count()).select_from(Feedback)),
            "open": n(select(func.count()).select_from(SessionState).where(SessionState.status != "closed",
                                                                           not_(poisoned))),
            "trajectories": n(select(func.count()).select_from(Trajectory)),
            "scored": n(select(func.count()).select_from(ScoredTrajectoryRow).join(Trajectory, of_stored)
                        .where(ScoredTrajectoryRow.reward_spec_version == spec)) if spec else 0,
        }


def settle(fleet: Fleet, users: Users, engine: Any, timeout_s: float) -> dict[str, Any]:
    """Wait until the spool is drained, every received generation and accepted feedback is stored
    (but those of sessions an erasure tombstoned), every session closed and every trajectory scored,
    unchanged over two polls; returns the figures."""
    from sqlalchemy import select

    from flywheel.db.models import ErasureSession, Generation, RewardSpecRow

    started = time.monotonic()
    deadline = started + timeout_s
    previous: dict[str, Any] | None = None
    figures: dict[str, Any] = {}
    received = {gid: r.session_id for gid, r in users.log.received.items()}
    while time.monotonic() < deadline:
        try:
            depth = fleet.capture()
            with engine.connect() as conn:
                spec = conn.scalar(select(RewardSpecRow.version).order_by(RewardSpecRow.created_at).limit(1))
                stored = {gid for (gid,) in conn.execute(select(Generation.generation_id))}
                erased = set(conn.scalars(select(ErasureSession.session_id)))
            missing = [gid for gid, sid in received.items() if gid not in stored and sid not in erased]
            figures = {**_counts(engine, spec), "spool": depth.get("events"), "received_missing": len(missing)}
        except Exception as exc:  # a service still recovering
            figures = {"error": f"{type(exc).__name__}: {exc}"}
            time.sleep(1.0)
            continue
        done = (figures["spool"] == 0 and figures["received_missing"] == 0 and figures["open"] == 0
                and figures["trajectories"] == figures["scored"] and figures["trajectories"] > 0)
        if done and figures == previous:
            return {**figures, "settled": True, "settle_s": round(time.monotonic() - started, 1)}
        previous = figures if done else None
        time.sleep(1.0)
    return {**figures, "settled": False, "settle_s": round(time.monotonic() - started, 1)}


def converge_nodes(fleet: Fleet, watcher: NodeWatcher, registry: Any, timeout_s: float = 20.0) -> None:
    """With the rollout controller stopped: wait until every node serves the stable version or
    reports failed_update."""
    stable = registry.latest("stable")

    def converged() -> bool:
        with httpx.Client(timeout=2.0) as client:
            watcher.poll(client)
        return all((h := watcher.last.get(n)) is not None and (h.get("version") == stable.version
                                                              or h.get("update_status") == "failed_update")
                   for n in NODES)

    try:
        wait_for("the nodes to converge on the stable version", converged, timeout_s, 0.5)
    except TimeoutError as exc:
        log.warning("%s", exc)


def rescore(fleet: Fleet, scenario: str) -> tuple[str, str]:
    """``flywheel rewards rescore`` under a copy of the live spec with another version; returns
    (that version, the command's output)."""
    spec_path = fleet.base.rewards.spec_path
    version = f"chaos-rescore-{scenario}"[:64]
    path = fleet.run_dir / "rescore-spec.toml"
    path.write_text(f'extends = {json.dumps(spec_path or "default")}\nversion = "{version}"\n')
    result = subprocess.run([sys.executable, "-m", "launch.cli", "--config", str(fleet.procs["rewards-1"].config),
                             "rewards", "rescore", "--spec", str(path)], capture_output=True, text=True, timeout=600)
    return version, (result.stdout + result.stderr).strip()[-2000:]


def registry_for(settings: Settings, engine: Any) -> Any:
    """The weight registry of ``settings``' model line on ``engine``."""
    from flywheel.db.session import make_session_factory
    from flywheel.weights.registry import Registry
    from flywheel.weights.store import make_store

    return Registry(make_session_factory(engine), make_store(settings), settings.model.line)


def _read_rows(conn: Any) -> tuple[list[GenRow], list[FeedbackRow], list[TrajectoryRow]]:
    """The generation, feedback and trajectory rows (what :func:`reread` reads again)."""
    from sqlalchemy import select

    from flywheel.db.models import Feedback, Generation, Trajectory

    return ([GenRow(r.generation_id, r.event_id, r.session_id, r.model_version, r.node_id, r.payload, _utc(r.ts))
             for r in conn.execute(select(Generation))],
            [FeedbackRow(r.feedback_id, r.event_id, r.session_id, r.state, r.payload)
             for r in conn.execute(select(Feedback))],
            [TrajectoryRow(r.trajectory_id, r.revision, r.session_id, r.tenant, r.closed_reason, r.payload)
             for r in conn.execute(select(Trajectory).order_by(Trajectory.id))])


def _utc(value: datetime) -> datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def _version_row(r: Any, rebuild_error: str | None) -> VersionRow:
    metrics = r.metrics or {}
    return VersionRow(r.version, r.kind, r.parent, r.sha256, r.status, tuple(metrics.get("trajectory_ids") or ()),
                      metrics.get("publish_token"), rebuild_error, _utc(r.created_at) if r.created_at else None)


def _headers(record: Any) -> dict[str, str]:
    return {k: (v or b"").decode("utf-8", errors="replace") for k, v in (record.headers or [])}


def dead_letters(settings: Settings) -> list[DeadLetter]:
    """Every record of the consumed topics' dead-letter topics (``<topic>.dlq``), read to the end."""
    from kafka import KafkaConsumer

    from flywheel.bus import DLQ_ORIGIN_OFFSET, DLQ_ORIGIN_PARTITION, DLQ_REASON, dlq_topic

    bootstrap = settings.bus.bootstrap_servers
    lister = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None)
    try:
        existing = lister.topics()
    finally:
        lister.close(autocommit=False)
    out = []
    for name in TOPICS:
        topic = dlq_topic(settings.topic(name))
        if topic not in existing:  # nothing was ever dead-lettered from it
            continue
        for record in read_topic(bootstrap, topic):
            headers = _headers(record)
            out.append(DeadLetter(name, int(headers.get(DLQ_ORIGIN_PARTITION, -1)),
                                  int(headers.get(DLQ_ORIGIN_OFFSET, -1)), headers.get(DLQ_REASON, ""),
                                  headers.get(HEADER)))
    return out


def find_poison(settings: Settings, poison: list[PoisonRecord]) -> dict[str, list[str]]:
    """Where each of ``poison`` is on its own topic (``feedback[2]@153``; a chunked record: each chunk)."""
    wanted = {p.id for p in poison}
    found: dict[str, list[str]] = {}
    for name in sorted({p.topic for p in poison}):
        for record in read_topic(settings.bus.bootstrap_servers, settings.topic(name)):
            pid = _headers(record).get(HEADER)
            if pid in wanted:
                found.setdefault(pid, []).append(f"{name}[{record.partition}]@{record.offset}")
    return found


def read_forgotten(conn: Any, settings: Settings, subjects: list[ForgetSubject]) -> Forgotten:
    """The erasures, their tombstoned sessions, the trained rows still naming those sessions'
    trajectories and the records of those sessions on the ``trajectories`` and ``scored`` topics."""
    from sqlalchemy import select

    from flywheel.db.models import Erasure, ErasureSession, TrainedTrajectory

    erasures = [ErasureRow(r.id, r.tenant, r.user_hash, r.session_id, r.state, _utc(r.requested_at),
                           _utc(r.completed_at) if r.completed_at else None, dict(r.counts or {}),
                           tuple(int(v["version"]) for v in r.trained_into or ()))
                for r in conn.execute(select(Erasure).order_by(Erasure.id))]
    sessions = {}
    for r in conn.execute(select(ErasureSession).order_by(ErasureSession.added_at)):
        sessions.setdefault((r.tenant, r.session_id), (int(r.erasure_id), _utc(r.added_at)))
    out = Forgotten(erasures, sessions, subjects=list(subjects))
    ids = trajectory_ids_of(out)
    if ids:
        out.trained = {tid: int(v) for tid, v in conn.execute(
            select(TrainedTrajectory.trajectory_id, TrainedTrajectory.version)
            .where(TrainedTrajectory.trajectory_id.in_(list(ids))))}
        wanted = {sid for _, sid in sessions}
        for name in ("trajectories", "scored"):
            for record in read_topic(settings.bus.bootstrap_servers, settings.topic(name)):
                sid = (record.key or b"").decode("utf-8", errors="replace")
                if sid in wanted:
                    out.records.append(TopicRecord(name, sid, f"{name}[{record.partition}]@{record.offset}",
                                                   datetime.fromtimestamp(record.timestamp / 1000, UTC)))
    return out


def collect(fleet: Fleet, users: Users, watcher: NodeWatcher, engine: Any, registry: Any, rescore_spec: str,
            expectations: list[Expectation], settled: dict[str, Any],
            poison: list[PoisonRecord] | None = None, subjects: list[ForgetSubject] | None = None) -> Snapshot:
    """Read the database, the node logs, the watcher and the dead-letter topics into a :class:`Snapshot`."""
    from sqlalchemy import select

    from flywheel.db.models import ModelVersion, RewardSpecRow, ScoredTrajectoryRow, SessionState, VersionTransition

    with engine.connect() as conn:
        generations, feedback, trajectories = _read_rows(conn)
        session_status = {r.session_id: (r.status, r.revision) for r in conn.execute(select(SessionState))}
        scored = [ScoredRow(r.trajectory_id, r.revision, r.reward_spec_version, r.payload)
                  for r in conn.execute(select(ScoredTrajectoryRow))]
        specs = [v for (v,) in conn.execute(select(RewardSpecRow.version).order_by(RewardSpecRow.created_at))]
        version_rows = list(conn.execute(select(ModelVersion).where(ModelVersion.model_line == fleet.base.model.line)))
        ever_stable = {v for (v,) in conn.execute(select(VersionTransition.version)
                                                 .where(VersionTransition.to_status == "stable"))}
        promoted_at: dict[int, datetime] = {}
        for version, at in conn.execute(select(VersionTransition.version, VersionTransition.at)
                                        .where(VersionTransition.model_line == fleet.base.model.line,
                                               VersionTransition.to_status.in_(("canary", "stable")))):
            promoted_at[version] = min(promoted_at.get(version, _utc(at)), _utc(at))
        forgotten = read_forgotten(conn, fleet.base, subjects or [])
    loaded, live = node_logs(fleet)
    for name in NODES:
        for version, shas in watcher.live[name].items():
            loaded[name][version] |= shas
            live[name].add(version)
    served = {v for node in loaded.values() for v in node}
    versions = []
    for r in version_rows:
        error = None
        if r.version in served:
            try:
                registry.load(r.version)
            except Exception as exc:  # WeightsError and anything the store raises: reported, not raised
                error = f"{type(exc).__name__}: {exc}"[:300]
        versions.append(_version_row(r, error))
    live_spec = next((v for v in specs if v != rescore_spec), "")
    poison = list(poison or [])
    letters = dead_letters(fleet.base)
    lettered = {d.poison for d in letters}
    missing = [p for p in poison if p.id not in lettered]
    return Snapshot(users.log, generations, feedback, session_status, trajectories, scored, live_spec, rescore_spec,
                    versions, ever_stable, promoted_at, {n: dict(v) for n, v in loaded.items()}, live,
                    dict(watcher.last), expectations, settled, poison, letters,
                    find_poison(fleet.base, missing) if missing else {}, forgotten)


def reread(s: Snapshot, database_url: str) -> None:
    """Read the generation, feedback, trajectory and version rows of a finished scenario into ``s``
    again (the rebuild errors stay as :func:`collect` found them)."""
    from sqlalchemy import select

    from flywheel.db.models import ModelVersion
    from flywheel.db.session import make_engine

    engine = make_engine(database_url)
    try:
        with engine.connect() as conn:
            s.generations, s.feedback, s.trajectories = _read_rows(conn)
            errors = {v.version: v.rebuild_error for v in s.versions}
            s.versions = [_version_row(r, errors.get(r.version)) for r in conn.execute(select(ModelVersion))]
    finally:
        engine.dispose()
