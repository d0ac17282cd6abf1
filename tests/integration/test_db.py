"""flywheel.db against real PostgreSQL and SQLite: migrations, schema drift, idempotent inserts,
timestamps, start-up wait, and several processes writing one SQLite file."""

from __future__ import annotations

import multiprocessing
import random
import uuid
from datetime import UTC, datetime, timedelta, timezone

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import func, inspect, select

from flywheel.db import (
    Base,
    DatabaseUnavailable,
    Feedback,
    Generation,
    SessionState,
    downgrade,
    insert_ignore,
    make_engine,
    make_session_factory,
    upgrade,
    wait_for_db,
)

pytestmark = pytest.mark.integration

TABLES = {
    "generations",
    "feedback",
    "sessions",
    "trajectories",
    "scored_trajectories",
    "model_versions",
    "version_transitions",
    "nodes",
    "api_keys",
    "reward_specs",
    "reward_version_stats",
    "trained_trajectories",
    "rollout_decisions",
    "erasures",
    "erasure_sessions",
}


def _tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def _diff(url: str, metadata: sa.MetaData) -> list:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            return compare_metadata(context, metadata)
    finally:
        engine.dispose()


def _generation(rng: random.Random, **overrides) -> dict:
    row = {
        "event_id": uuid.uuid4().hex,
        "generation_id": uuid.uuid4().hex,
        "tenant": "t1",
        "session_id": f"s-{rng.randrange(10**6)}",
        "model_line": "tiny-sim",
        "model_version": rng.randrange(100),
        "node_id": "node-0",
        "ts": datetime.now(UTC),
        "payload": {"tokens": [rng.randrange(50_000) for _ in range(rng.randrange(1, 20))], "text": "héllo"},
    }
    row.update(overrides)
    return row


def test_upgrade_downgrade_upgrade(db_url):
    upgrade(db_url)
    assert _tables(db_url) == TABLES
    upgrade(db_url)  # already at head: a no-op
    assert _tables(db_url) == TABLES
    downgrade(db_url)
    assert _tables(db_url) == set()
    upgrade(db_url)
    assert _tables(db_url) == TABLES
    assert _diff(db_url, Base.metadata) == []


def test_migrations_match_models(migrated_db_url):
    assert _diff(migrated_db_url, Base.metadata) == []

    # The comparison is not blind: a model change the migrations lack shows up.
    drifted = sa.MetaData(naming_convention=Base.metadata.naming_convention)
    for table in Base.metadata.sorted_tables:
        table.to_metadata(drifted)
    drifted.tables["generations"].append_column(sa.Column("extra", sa.Integer(), nullable=True))
    sa.Index("ix_nodes_region", drifted.tables["nodes"].c.region)
    kinds = {entry[0] if isinstance(entry, tuple) else entry[0][0] for entry in _diff(migrated_db_url, drifted)}
    assert kinds == {"add_column", "add_index"}


def test_payloads_are_compressed_with_lz4_on_postgresql(pg_url):
    upgrade(pg_url)
    engine = sa.create_engine(pg_url)
    try:
        with engine.connect() as conn:
            methods = dict(conn.execute(sa.text(
                "SELECT attrelid::regclass::text, attcompression FROM pg_attribute "
                "WHERE attname = 'payload' AND attrelid::regclass::text = ANY(:tables)"),
                {"tables": ["generations", "feedback", "trajectories", "scored_trajectories"]}).all())
            lz4 = conn.execute(sa.text(
                "SELECT 'lz4' = ANY(enumvals) FROM pg_settings WHERE name = 'default_toast_compression'")).scalar()
    finally:
        engine.dispose()
    assert len(methods) == 4
    assert set(methods.values()) == ({"l"} if lz4 else {""}), methods


def test_insert_ignore_is_idempotent(migrated_db_url):
    rng = random.Random()
    engine = make_engine(migrated_db_url)
    sessions = make_session_factory(engine)
    row = _generation(rng)
    try:
        with sessions() as s:
            assert insert_ignore(s, Generation, [row]) == 1
            s.commit()
        with sessions() as s:
            assert insert_ignore(s, Generation, [row]) == 0
            s.commit()
        with sessions() as s:
            assert s.scalar(select(func.count()).select_from(Generation)) == 1
            stored = s.get(Generation, row["event_id"])
            assert stored.payload == row["payload"]
            assert stored.ts == row["ts"]

        # A batch mixing replays and new rows inserts only the new ones, and says how many.
        fresh = [_generation(rng) for _ in range(rng.randrange(3, 9))]
        batch = fresh + [row] + fresh[:2]
        rng.shuffle(batch)
        with sessions() as s:
            assert insert_ignore(s, Generation, batch) == len(fresh)
            s.commit()
        with sessions() as s:
            assert s.scalar(select(func.count()).select_from(Generation)) == len(fresh) + 1
        with sessions() as s:
            assert insert_ignore(s, Generation, []) == 0
    finally:
        engine.dispose()


def test_insert_ignore_honours_every_unique_key_and_defaults(migrated_db_url):
    engine = make_engine(migrated_db_url)
    sessions = make_session_factory(engine)
    now = datetime.now(UTC)
    base = {
        "feedback_id": "fb-1",
        "tenant": "t1",
        "session_id": "s1",
        "generation_id": None,
        "kind": "explicit",
        "signal": "thumbs_up",
        "value": 1.0,
        "ts": now,
        "payload": {},
    }
    try:
        with sessions() as s:
            assert insert_ignore(s, Feedback, [{**base, "event_id": "e1"}]) == 1
            # A client retry: new event id, same (tenant, feedback_id) -> not counted twice.
            assert insert_ignore(s, Feedback, [{**base, "event_id": "e2"}]) == 0
            # Same feedback id for another tenant is a different piece of feedback.
            assert insert_ignore(s, Feedback, [{**base, "event_id": "e3", "tenant": "t2"}]) == 1
            s.commit()
        with sessions() as s:
            rows = s.scalars(select(Feedback).order_by(Feedback.event_id)).all()
            assert [(r.event_id, r.tenant, r.state) for r in rows] == [("e1", "t1", "pending"), ("e3", "t2", "pending")]
    finally:
        engine.dispose()


def test_insert_ignore_does_not_commit(migrated_db_url):
    engine = make_engine(migrated_db_url)
    sessions = make_session_factory(engine)
    try:
        with sessions() as s:
            assert insert_ignore(s, Generation, [_generation(random.Random())]) == 1
            s.rollback()
        with sessions() as s:
            assert s.scalar(select(func.count()).select_from(Generation)) == 0
    finally:
        engine.dispose()


def test_timestamps_are_utc_and_aware(migrated_db_url):
    engine = make_engine(migrated_db_url)
    sessions = make_session_factory(engine)
    local = datetime(2024, 5, 6, 7, 8, 9, 123456, tzinfo=timezone(timedelta(hours=-5, minutes=-30)))
    later = local + timedelta(minutes=1)
    try:
        with sessions() as s:
            s.add(SessionState(tenant="t", session_id="a", status="open", last_event_at=local, revision=0))
            s.add(SessionState(tenant="t", session_id="b", status="open", last_event_at=later, revision=0))
            s.commit()
        with sessions() as s:
            a = s.get(SessionState, ("t", "a"))
            assert a.last_event_at == local
            assert a.last_event_at.utcoffset() == timedelta(0)
            assert a.closed_at is None
            # Ordering and filtering are by instant, on both databases.
            cutoff = datetime(2024, 5, 6, 12, 38, 30, tzinfo=UTC)  # between a and b in UTC
            assert s.scalars(select(SessionState.session_id).where(SessionState.last_event_at > cutoff)).all() == ["b"]
        with sessions() as s:
            s.add(SessionState(tenant="t", session_id="c", status="open", last_event_at=datetime(2024, 1, 1), revision=0))
            with pytest.raises(sa.exc.StatementError, match="naive datetime"):
                s.commit()
    finally:
        engine.dispose()


def test_sqlite_engine_settings(tmp_path):
    url = f"sqlite:///{tmp_path / 'not' / 'yet' / 'there.db'}"
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() >= 30_000
    finally:
        engine.dispose()
    assert (tmp_path / "not" / "yet" / "there.db").is_file()


def test_wait_for_db(db_url):
    wait_for_db(db_url, timeout_s=5)


def test_wait_for_db_names_the_url_without_password():
    url = "postgresql+psycopg2://flywheel:s3cret-pw@127.0.0.1:1/nowhere"
    with pytest.raises(DatabaseUnavailable) as info:
        wait_for_db(url, timeout_s=0.5)
    message = str(info.value)
    assert "127.0.0.1:1/nowhere" in message
    assert "s3cret-pw" not in message


# --- several processes, one SQLite file -----------------------------------------------------------


def _hammer(url: str, worker: int, n: int, barrier, errors) -> None:
    """Child process: n transactions, each an idempotent insert plus a read-modify-write."""
    try:
        engine = make_engine(url)
        sessions = make_session_factory(engine)
        rng = random.Random(worker)
        barrier.wait(timeout=60)
        for i in range(n):
            with sessions() as s:
                # Read first, then write: the pattern that fails with "database is locked" (or loses
                # updates) unless transactions take the write lock when they begin.
                state = s.get(SessionState, ("t", "shared"))
                state.revision += 1
                state.last_event_at = datetime.now(UTC)
                row = _generation(rng, event_id=f"w{worker}-{i}", generation_id=f"w{worker}-{i}")
                assert insert_ignore(s, Generation, [row]) == 1
                s.commit()
        engine.dispose()
    except BaseException as exc:  # reported to the parent, then re-raised for the exit code
        errors.put(f"worker {worker}: {exc!r}")
        raise


def test_sqlite_concurrent_processes(sqlite_url):
    upgrade(sqlite_url)
    engine = make_engine(sqlite_url)
    sessions = make_session_factory(engine)
    with sessions() as s:
        s.add(SessionState(tenant="t", session_id="shared", last_event_at=datetime.now(UTC), revision=0))
        s.commit()

    ctx = multiprocessing.get_context("spawn")
    n, workers = 150, 2
    barrier, errors = ctx.Barrier(workers), ctx.Queue()
    procs = [ctx.Process(target=_hammer, args=(sqlite_url, w, n, barrier, errors)) for w in range(workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    reported = []
    while not errors.empty():
        reported.append(errors.get())
    assert [p.exitcode for p in procs] == [0] * workers, reported

    with sessions() as s:
        assert s.scalar(select(func.count()).select_from(Generation)) == n * workers
        assert s.get(SessionState, ("t", "shared")).revision == n * workers
    engine.dispose()


def test_json_columns_read_back_what_they_wrote_beyond_64_bits(db_url):
    """The engines' JSON writer and reader are one pair (``flywheel.jsonpolicy.db_dumps`` /
    ``db_loads``): a payload holding an integer orjson cannot read (a row from before the edge
    enforced the JSON policy) reads back whole, on SQLite and PostgreSQL, instead of failing every
    later read of its session; a NaN is refused, never stored as null."""
    engine = make_engine(db_url)
    table = sa.Table(f"json_pair_{uuid.uuid4().hex[:8]}", sa.MetaData(), sa.Column("id", sa.Integer, primary_key=True),
                     sa.Column("payload", sa.JSON))
    table.create(engine)
    try:
        values = [{"data": {"a": 10**4000}}, {"data": {"a": 2**64 + 1}}, {"t": [1, 2], "l": [-0.5], "s": "é\u2028"}]
        with engine.begin() as conn:
            conn.execute(table.insert(), [{"id": i, "payload": v} for i, v in enumerate(values)])
        with engine.connect() as conn:
            assert [row.payload for row in conn.execute(sa.select(table).order_by(table.c.id))] == values
        with pytest.raises(sa.exc.StatementError, match="NaN"), engine.begin() as conn:
            conn.execute(table.insert(), [{"id": 9, "payload": {"x": float("nan")}}])
    finally:
        table.drop(engine)
        engine.dispose()
