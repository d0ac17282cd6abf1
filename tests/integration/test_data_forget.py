"""Erasing a data subject (flywheel/erasure.py, ``flywheel data forget``) on SQLite and PostgreSQL:
every row of the subject goes and nobody else's, the versions trained on it are named, a crash
mid-deletion is completed by ``--resume`` with exact counts, and on SQLite the deleted text is in
neither the database file nor its write-ahead log. The data is test_data_export.py's."""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from flywheel import erasure
from flywheel.data_cli import main
from flywheel.db.models import Erasure, Feedback, Generation, ScoredTrajectoryRow, SessionState, Trajectory
from flywheel.identity import SECRET_FILE
from flywheel.settings import load_settings
from flywheel.subjects import KINDS, Subject, export, user_subject
from tests.integration.test_data_export import RAW, SECRET, stored  # noqa: F401 (fixture)

pytestmark = pytest.mark.integration

ALICE = user_subject(SECRET, "acme", RAW)


def rows_of(sessions, subject: Subject) -> dict[str, int]:
    counts = export(sessions, subject, io.BytesIO())
    return {kind: n for kind, n in counts.items() if n}


def left(sessions) -> dict[str, list[Any]]:
    with sessions() as db:
        return {
            "generations": sorted(db.scalars(select(Generation.generation_id))),
            "feedback": sorted(db.scalars(select(Feedback.event_id))),
            "trajectories": sorted(set(db.scalars(select(Trajectory.trajectory_id)))),
            "scored": sorted(set(db.scalars(select(ScoredTrajectoryRow.trajectory_id)))),
            "sessions": sorted(tuple(r) for r in db.execute(select(SessionState.tenant, SessionState.session_id))),
        }


def test_forgetting_a_user_deletes_their_rows_and_no_one_elses(stored) -> None:  # noqa: F811
    sessions = stored
    before = rows_of(sessions, ALICE)
    assert before["generation"] == 4
    erasure_id = erasure.request(sessions, ALICE, "dpo@acme")
    with sessions() as db:
        assert erasure.tombstoned(db, ALICE) and not erasure.tombstoned(db, Subject("globex", user_hash=ALICE.user_hash))
    outcome = erasure.complete(sessions, erasure_id, batch=2, settle_s=0)
    assert rows_of(sessions, ALICE) == {} and rows_of(sessions, Subject("acme", session_id="s2")) == {"generation": 1}
    assert outcome.trained_into == [{"model_line": "line", "version": 3}]
    assert outcome.counts["generation"] == 4 and sum(outcome.counts.values()) > sum(before.values())  # shared s2 whole
    rest = left(sessions)
    assert rest["generations"] == ["g4", "g6", "g7", "g8"]  # bob's (also in the shared s2), no one's, globex's
    assert rest["trajectories"] == ["tr-acme-s4", "tr-globex-s1"] == rest["scored"]
    assert "fe-acme-f6" in rest["feedback"] and "fe-globex-f1" in rest["feedback"]
    assert rest["sessions"] == [("acme", "s4"), ("globex", "s1")]  # another tenant's session of the same id stays
    with sessions() as db:
        row = db.get(Erasure, erasure_id)
        assert (row.state, row.requested_by, row.counts) == ("done", "dpo@acme", outcome.counts)
        assert row.completed_at is not None and row.user_hash == ALICE.user_hash and row.session_id is None
    again = erasure.complete(sessions, erasure_id, settle_s=0)  # idempotent: nothing more to delete
    assert again.counts == outcome.counts


def test_a_crash_mid_deletion_leaves_it_pending_and_resume_completes_it_with_exact_counts(stored) -> None:  # noqa: F811
    sessions = stored
    total = rows_of(sessions, Subject("acme", session_id="s1"))
    erasure_id = erasure.request(sessions, Subject("acme", session_id="s1"), "ops")
    calls = {"n": 0}

    def crashing() -> Any:
        calls["n"] += 1
        # the read of the request, the sessions it covers, the trained versions, two deleting transactions, the crash
        if calls["n"] == 6:
            raise RuntimeError("killed")
        return sessions()

    crashing.kw = sessions.kw  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="killed"):
        erasure.complete(crashing, erasure_id, batch=1)  # type: ignore[arg-type]
    assert erasure.pending(sessions) == [erasure_id]
    gone = sum(total.values()) - sum(rows_of(sessions, Subject("acme", session_id="s1")).values())
    with sessions() as db:
        assert gone > 0 and sum(db.get(Erasure, erasure_id).counts.values()) == gone  # counted as deleted
    (outcome,) = erasure.resume(sessions)
    assert erasure.pending(sessions) == [] and rows_of(sessions, Subject("acme", session_id="s1")) == {}
    assert outcome.counts == {kind: total.get(kind, 0) for kind in KINDS}


def test_the_janitor_completes_an_erasure_its_process_left_pending_once_it_is_stale(stored, tmp_path) -> None:  # noqa: F811
    from datetime import UTC, datetime

    from flywheel.janitor import tasks

    sessions = stored
    young = erasure.request(sessions, Subject("acme", session_id="s4"), "ops")
    stale = erasure.request(sessions, Subject("acme", session_id="s1"), "ops")  # its gateway died
    with sessions() as db, db.begin():
        db.get(Erasure, stale).requested_at = datetime.now(UTC) - erasure.STALE_AFTER * 2
    turns = dict(tasks(load_settings(None, data_dir=str(tmp_path)), sessions, None))
    assert turns["erasure_resume"]() == [stale]  # the young one may still be completing elsewhere
    assert erasure.pending(sessions) == [young] and rows_of(sessions, Subject("acme", session_id="s1")) == {}
    assert turns["erasure_sweep"]() == 0  # nothing stored since


def test_the_janitor_completes_a_stale_erasure_between_its_turns(stored, tmp_path, monkeypatch) -> None:  # noqa: F811
    """A request left pending by a crash does not wait for the next hourly turn (nor for, or on,
    the retention job): the janitor looks for stale ones every ERASURES_EVERY_S while it waits."""
    import threading
    import time
    from datetime import UTC, datetime

    from flywheel import janitor

    sessions = stored
    monkeypatch.setattr(janitor, "ERASURES_EVERY_S", 0.2)
    url = sessions.kw["bind"].url.render_as_string(hide_password=False)
    settings = load_settings(None, data_dir=str(tmp_path), db={"url": url}, bus={"kind": "local"},
                             retention={"interval_s": 3600})
    stop = threading.Event()
    worker = threading.Thread(target=janitor.run, args=(settings, stop))
    worker.start()
    try:
        time.sleep(1.0)  # its turn is done: the next one is an hour away
        stale = erasure.request(sessions, Subject("acme", session_id="s1"), "ops")  # its gateway died
        with sessions() as db, db.begin():
            db.get(Erasure, stale).requested_at = datetime.now(UTC) - erasure.STALE_AFTER * 2
        deadline = time.monotonic() + 15
        while erasure.pending(sessions) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        stop.set()
        worker.join(30)
    assert erasure.pending(sessions) == [] and rows_of(sessions, Subject("acme", session_id="s1")) == {}


def test_on_sqlite_the_deleted_text_leaves_the_file_and_its_log(sqlite_url: str) -> None:
    from datetime import UTC, datetime

    from flywheel.db.session import make_engine, make_session_factory, upgrade

    upgrade(sqlite_url)
    engine = make_engine(sqlite_url)
    try:
        sessions = make_session_factory(engine)
        marker = "a-secret-only-alice-typed-7f3a"
        with sessions() as db, db.begin():
            db.add(Generation(event_id="ev-g9", generation_id="g9", tenant="acme", session_id="s9", model_line="line",
                              model_version=1, node_id="n1", ts=datetime.now(UTC), user_hash=ALICE.user_hash,
                              payload={"request": {"messages": [{"role": "user", "content": f"remember {marker}"}]}}))
        path = Path(sqlite_url.removeprefix("sqlite:///"))

        def on_disk() -> bytes:
            return b"".join(p.read_bytes() for p in (path, Path(f"{path}-wal")) if p.exists())

        assert marker.encode() in on_disk()  # the check below can fail
        erasure.complete(sessions, erasure.request(sessions, ALICE, "ops"), settle_s=0)
        assert marker.encode() not in on_disk()
    finally:
        engine.dispose()


def test_the_command_forgets_resumes_and_refuses_bad_arguments(stored, migrated_db_url: str, tmp_path: Path,  # noqa: F811
                                                               capsys) -> None:
    sessions = stored
    settings = load_settings(data_dir=str(tmp_path), db={"url": migrated_db_url}, gateway={"user_id_secret": SECRET})

    def run(*argv: str, **extra: Any) -> int:
        fields = {"action": "forget", "tenant": None, "user": None, "session": None, "by": "dpo", "resume": False}
        fields.update(extra)
        return main(argparse.Namespace(**fields), settings)

    assert run(tenant="acme", user=RAW) == 0
    out, err = capsys.readouterr()
    answer = json.loads(out.splitlines()[0])
    assert answer["user_hash"] == ALICE.user_hash and answer["deleted"]["generation"] == 4 and RAW not in out + err
    assert answer["trained_into"] == [{"model_line": "line", "version": 3}] and "not unlearned" in err
    assert rows_of(sessions, ALICE) == {}
    assert run(resume=True) == 0 and "no erasure was pending" in capsys.readouterr().err
    assert run(resume=True, tenant="acme") == 2
    assert run(tenant="acme") == 2 and run(tenant="acme", user=RAW, session="s1") == 2
    no_secret = load_settings(data_dir=str(tmp_path / "elsewhere"), db={"url": migrated_db_url})
    assert main(argparse.Namespace(action="forget", tenant="acme", user=RAW, session=None, by="x", resume=False),
                no_secret) == 1
    assert not (tmp_path / "elsewhere" / SECRET_FILE).exists()
    with sessions() as db:
        assert db.scalar(select(func.count()).select_from(Erasure)) == 1
