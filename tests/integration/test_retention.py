"""The retention job (flywheel/retention.py, ``flywheel data retain``) on SQLite and PostgreSQL:
exactly the rows older than each tenant's retention go (a tenant's own section over ``"*"``), live
sessions keep their raw events, a session row stays while its trajectories do, batches are small,
a second run deletes nothing, a dry run counts what a run deletes, and on SQLite the deleted text
is in neither the database file nor its write-ahead log."""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import select

from flywheel.consent import TenantPolicy
from flywheel.data_cli import main
from flywheel.db.models import (
    Feedback,
    Generation,
    ScoredTrajectoryRow,
    SessionState,
    TrainedTrajectory,
    Trajectory,
)
from flywheel.retention import run_once
from flywheel.settings import load_settings

pytestmark = pytest.mark.integration

NOW = datetime.now(UTC).replace(microsecond=0)  # the CLI runs on the real clock
TENANTS = {
    "*": TenantPolicy(retention_days=30),
    "acme": TenantPolicy(retention_days={"raw_events": 7, "trajectories": 90}),  # scores: forever
    "globex": TenantPolicy(),  # listed, no retention: "*" does not apply
}
MARK = "retention-secret-marker"


def ago(days: float) -> datetime:
    return NOW - timedelta(days=days)


def add_session(db, tenant: str, session: str, *, events_at: float, last_at: float, status: str = "closed",
                trajectory_at: float | None = None, scored_at: float | None = None) -> None:
    """One session: two generations and a feedback at ``events_at`` days ago, its ``sessions`` row,
    and optionally a trajectory (with a trained row) and its score."""
    for i in range(2):
        db.add(Generation(event_id=f"ge-{tenant}-{session}-{i}", generation_id=f"g-{tenant}-{session}-{i}",
                          tenant=tenant, session_id=session, model_line="line", model_version=1, node_id="n",
                          ts=ago(events_at), payload={"text": f"{MARK}-{tenant}-{session}"}, user_hash=None))
    db.add(Feedback(event_id=f"fe-{tenant}-{session}", feedback_id=f"f-{session}", tenant=tenant, session_id=session,
                    generation_id=f"g-{tenant}-{session}-0", kind="explicit", signal="thumbs", value=1.0,
                    ts=ago(events_at), state="joined", payload={}))
    db.add(SessionState(tenant=tenant, session_id=session, status=status, last_event_at=ago(last_at),
                        closed_at=None if status == "open" else ago(last_at), revision=1))
    if trajectory_at is not None:
        tid = f"tr-{tenant}-{session}"
        db.add(Trajectory(trajectory_id=tid, revision=0, event_id=f"te-{tid}", tenant=tenant, session_id=session,
                          model_line="line", closed_reason="outcome", ts=ago(trajectory_at), payload={"t": MARK}))
        db.add(TrainedTrajectory(trajectory_id=tid, model_line="line", version=1, trained_at=ago(trajectory_at)))
    if scored_at is not None:
        tid = f"tr-{tenant}-{session}"
        db.add(ScoredTrajectoryRow(trajectory_id=tid, revision=0, reward_spec_version="v1", event_id=f"se-{tid}",
                                   tenant=tenant, total_reward=1.0, ts=ago(scored_at), payload={}))


@pytest.fixture
def stored(sessions):
    with sessions() as db, db.begin():
        add_session(db, "zeta", "z1", events_at=40, last_at=40, trajectory_at=40, scored_at=40)  # all expired
        add_session(db, "zeta", "z2", events_at=40, last_at=1)  # old events of a live session
        add_session(db, "zeta", "z3", events_at=40, last_at=40, status="open")  # still open
        add_session(db, "zeta", "z4", events_at=10, last_at=10, trajectory_at=10, scored_at=10)  # fresh
        add_session(db, "acme", "a1", events_at=10, last_at=10, trajectory_at=10, scored_at=100)  # raw only
        add_session(db, "globex", "g1", events_at=400, last_at=400, trajectory_at=400, scored_at=400)  # forever
    return sessions


def left(sessions) -> dict[str, list]:
    with sessions() as db:
        return {
            "generations": sorted({(t, s) for t, s in db.execute(select(Generation.tenant, Generation.session_id))}),
            "feedback": sorted(tuple(r) for r in db.execute(select(Feedback.tenant, Feedback.session_id))),
            "sessions": sorted(tuple(r) for r in db.execute(select(SessionState.tenant, SessionState.session_id))),
            "trajectories": sorted(db.scalars(select(Trajectory.trajectory_id))),
            "trained": sorted(db.scalars(select(TrainedTrajectory.trajectory_id))),
            "scored": sorted(db.scalars(select(ScoredTrajectoryRow.trajectory_id))),
        }


def test_exactly_the_expired_rows_go_per_tenant_policy(stored) -> None:
    dry = run_once(TENANTS, stored, NOW, dry_run=True)
    report = run_once(TENANTS, stored, NOW, batch=1)
    assert report.deleted == {"generations": 4, "feedback": 2, "sessions": 1, "trajectories": 1,
                              "trained_trajectories": 1, "scored_trajectories": 1}
    # A dry run counts each table as it stands: the rows a run's own deletions free are not seen.
    cascading = ("trained_trajectories", "sessions")
    assert {k: v for k, v in dry.deleted.items() if k not in cascading} == {
        k: v for k, v in report.deleted.items() if k not in cascading}
    assert report.batches >= report.rows  # one row per transaction
    rest = left(stored)
    kept = [("acme", "a1"), ("globex", "g1"), ("zeta", "z2"), ("zeta", "z3"), ("zeta", "z4")]
    assert rest["generations"] == [("globex", "g1"), ("zeta", "z2"), ("zeta", "z3"), ("zeta", "z4")]
    assert rest["feedback"] == rest["generations"]
    assert rest["sessions"] == kept  # acme's a1 keeps its row while its trajectory stays
    assert rest["trajectories"] == ["tr-acme-a1", "tr-globex-g1", "tr-zeta-z4"] == rest["trained"]
    assert rest["scored"] == ["tr-acme-a1", "tr-globex-g1", "tr-zeta-z4"]
    again = run_once(TENANTS, stored, NOW)
    assert again.rows == 0 and left(stored) == rest  # idempotent


def test_later_clock_and_no_policy(stored) -> None:
    assert run_once({}, stored, NOW).rows == 0  # no policy: everything is kept forever
    run_once(TENANTS, stored, NOW)
    later = run_once(TENANTS, stored, NOW + timedelta(days=100))
    rest = left(stored)
    assert rest["trajectories"] == ["tr-globex-g1"] and rest["scored"] == ["tr-acme-a1", "tr-globex-g1"]
    assert ("zeta", "z3") in rest["sessions"] and ("zeta", "z3") in rest["generations"]  # open stays open
    assert later.deleted["sessions"] == 3  # z2, z4, and a1 once its trajectory went


def test_sqlite_keeps_no_deleted_text(stored, migrated_db_url) -> None:
    if not migrated_db_url.startswith("sqlite"):
        pytest.skip("the file check is SQLite's")
    assert run_once({"*": TenantPolicy(retention_days=1)}, stored, NOW + timedelta(days=1000)).rows
    path = Path(migrated_db_url.split("///", 1)[1])
    for file in (path, path.with_name(path.name + "-wal")):
        if file.exists():
            data = file.read_bytes()
            assert f"{MARK}-zeta-z1".encode() not in data and f"{MARK}-globex-g1".encode() not in data, file


def test_cli_retain_prints_the_report_and_exits_0(stored, migrated_db_url, tmp_path, capsys) -> None:
    settings = load_settings(None, data_dir=str(tmp_path), db={"url": migrated_db_url},
                             tenants={"*": {"retention_days": 1}})
    assert main(argparse.Namespace(action="retain", dry_run=True, json=True), settings) == 0
    dry = json.loads(capsys.readouterr().out)
    assert dry["dry_run"] and dry["deleted"]["generations"] == 2 * 5  # every session's but the open z3
    assert main(argparse.Namespace(action="retain", dry_run=False, json=False), settings) == 0
    assert "flywheel data retain: deleted" in capsys.readouterr().out
    with stored() as db:
        assert set(db.scalars(select(Generation.session_id))) == {"z3"}


def test_the_janitor_runs_the_job_and_expires_the_local_bus(tmp_path) -> None:
    import os
    import threading
    import time

    from flywheel.bus import make_bus
    from flywheel.db.session import make_session_factory, open_database
    from flywheel.health import health_path
    from flywheel.janitor import run

    settings = load_settings(None, data_dir=str(tmp_path), tenants={"*": {"retention_days": 1}},
                             bus={"retention_hours": 1}, retention={"interval_s": 60})
    engine = open_database(settings.database_url, 10)
    sessions = make_session_factory(engine)
    with sessions() as db, db.begin():
        add_session(db, "zeta", "z1", events_at=40, last_at=40, trajectory_at=40, scored_at=40)
    bus = make_bus(settings)
    producer = bus.producer()
    producer.send("t", "k", b"old")
    producer.close()
    log = next(bus.topic_dir("t").glob("*.log"))
    os.utime(log, (time.time() - 7200, time.time() - 7200))
    stop = threading.Event()
    worker = threading.Thread(target=run, args=(settings, stop))
    worker.start()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (log.exists() or left(sessions)["generations"]):
        time.sleep(0.1)
    assert health_path(settings, "janitor").exists()
    stop.set()
    worker.join(20)
    assert not worker.is_alive() and not log.exists() and left(sessions) == {k: [] for k in left(sessions)}
    engine.dispose()

