"""The console at scale on PostgreSQL: 1,000 versions and 100,000 sessions, every page under 300 ms
of server time, and no sequential scan of a large table on any page's queries (EXPLAIN).

The rows are generated in the database itself (``generate_series``), shaped as ingest, rewards, the
trainer and the rollout controller write them: per session one served turn, a trajectory and its
score; feedback on every fifth turn; per version its metrics (20 trajectory ids), two audit
entries, reward statistics and its ``trained_trajectories``. Tables that hold a handful of rows
(``api_keys``, ``reward_specs``, ``rollout_decisions``, ``nodes``) may be scanned: there a scan is
the right plan. Every other table may be scanned only while it is small (under 10,000 rows, where the
planner rightly prefers a scan), and only if an index would serve the query: the statements are
EXPLAINed again with ``enable_seqscan`` off, and none may still need a scan.
"""

from __future__ import annotations

import statistics

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from flywheel.db.session import make_engine, make_session_factory, upgrade
from flywheel.settings import load_settings
from serving.console import pages
from serving.gateway.app import create_app
from testbed.postgres import fresh_database

pytestmark = pytest.mark.integration

LINE = "scale-line"
VERSIONS = 1000
SESSIONS = 100_000
TENANTS = 10
BUDGET_MS = 300.0
SMALL_TABLES = {"api_keys", "reward_specs", "rollout_decisions", "nodes"}
#: A table with this many rows or more must never be scanned (below it a scan can be the best plan,
#: and the second check proves an index would serve the query as the table grows).
LARGE_ROWS = 10_000

GENERATE = [
    f"""INSERT INTO model_versions (model_line, version, kind, parent, sha256, store_key, bytes, full_bytes,
            fraction_changed, train_step, metrics, status, created_at)
        SELECT '{LINE}', v, CASE WHEN v % 50 = 0 THEN 'full' ELSE 'delta' END, CASE WHEN v = 0 THEN NULL ELSE v - 1 END,
            md5(v::text) || md5(v::text), 'k/' || v, 2000 + v, 100000, 0.02, v * 10,
            json_build_object('samples', 64, 'tokens', 6400, 'parity', 0.01, 'parity_max', 0.2, 'loss', 0.5,
                              'staleness', json_build_object('0', 50, '1', 14),
                              'trajectory_ids', (SELECT json_agg('t-' || (v * 20 + k)) FROM generate_series(0, 19) k)),
            CASE WHEN v = {VERSIONS - 2} THEN 'stable' WHEN v = {VERSIONS - 1} THEN 'canary' ELSE 'retired' END,
            now() - ({VERSIONS} - v) * interval '5 minutes'
        FROM generate_series(0, {VERSIONS - 1}) v""",
    f"""INSERT INTO version_transitions (model_line, version, from_status, to_status, reason, at)
        SELECT '{LINE}', v, s.f, s.t, 'rollout: generated ' || s.t, now() - ({VERSIONS} - v) * interval '5 minutes'
        FROM generate_series(0, {VERSIONS - 1}) v,
             (VALUES (NULL, 'candidate'), ('candidate', 'stable')) AS s(f, t)""",
    f"""INSERT INTO trained_trajectories (trajectory_id, model_line, version, trained_at)
        SELECT 't-' || i, '{LINE}', i / 20, now() FROM generate_series(0, {VERSIONS * 20 - 1}) i""",
    """INSERT INTO reward_specs (version, sha256, spec, created_at) VALUES ('spec-1', repeat('0', 64), '{}', now())""",
    f"""INSERT INTO reward_version_stats (model_line, model_version, reward_spec_version, train_count, train_sum,
            held_out_count, held_out_sum, flagged, flag_reason, updated_at)
        SELECT '{LINE}', v, 'spec-1', 100, 30 + v * 0.01, 20, 6 + v * 0.002, false, '', now()
        FROM generate_series(0, {VERSIONS - 1}) v""",
    f"""INSERT INTO sessions (tenant, session_id, status, last_event_at, closed_at, revision)
        SELECT 'tenant-' || (i % {TENANTS}), 'sess-' || i, CASE WHEN i % 100 = 0 THEN 'open' ELSE 'closed' END,
            now() - i * interval '1 second', now(), 0 FROM generate_series(0, {SESSIONS - 1}) i""",
    f"""INSERT INTO generations (event_id, generation_id, tenant, session_id, model_line, model_version, node_id, ts,
            payload)
        SELECT 'ge-' || i, 'g-' || i, 'tenant-' || (i % {TENANTS}), 'sess-' || i, '{LINE}', i % {VERSIONS}, 'node-a',
            now() - i * interval '1 second',
            json_build_object('request', json_build_object('messages', json_build_array(
                                  json_build_object('role', 'user', 'content', 'sort: c b a ' || i))),
                              'response', json_build_object('choices', json_build_array(json_build_object(
                                  'message', json_build_object('role', 'assistant', 'content', 'a b c')))),
                              'latency_ms', 20 + i % 50, 'finish_reason', 'stop',
                              'completion_token_ids', json_build_array(1, 2, 3))
        FROM generate_series(0, {SESSIONS - 1}) i""",
    f"""INSERT INTO feedback (event_id, feedback_id, tenant, session_id, generation_id, kind, signal, value, ts, state,
            payload)
        SELECT 'fe-' || i, 'f-' || i, 'tenant-' || (i % {TENANTS}), 'sess-' || i, 'g-' || i, 'explicit', 'thumbs',
            CASE WHEN i % 2 = 0 THEN 1.0 ELSE -1.0 END, now() - i * interval '1 second', 'joined', '{{}}'
        FROM generate_series(0, {SESSIONS - 1}, 5) i""",
    f"""INSERT INTO trajectories (trajectory_id, revision, event_id, tenant, session_id, model_line, closed_reason, ts,
            payload)
        SELECT 't-' || i, 0, 'te-' || i, 'tenant-' || (i % {TENANTS}), 'sess-' || i, '{LINE}', 'outcome',
            now() - i * interval '1 second', '{{}}' FROM generate_series(0, {SESSIONS - 1}) i""",
    f"""INSERT INTO scored_trajectories (trajectory_id, revision, reward_spec_version, event_id, tenant, total_reward,
            ts, payload)
        SELECT 't-' || i, 0, 'spec-1', 'se-' || i, 'tenant-' || (i % {TENANTS}), 0.5, now() - i * interval '1 second',
            json_build_object('turn_rewards', json_build_array(0.5), 'held_out', i % 10 = 0,
                              'reward_components', json_build_object('outcome', 0.5),
                              'segments', json_build_array(json_build_object('turns', json_build_array(
                                  json_build_object('generation_id', 'g-' || i)))))
        FROM generate_series(0, {SESSIONS - 1}) i""",
    f"""INSERT INTO rollout_decisions (model_line, action, version, reason, figures, decided_at)
        VALUES ('{LINE}', 'wait', {VERSIONS - 1}, 'window 60/3600s', '{{}}', now())""",
]


@pytest.fixture(scope="module")
def big_db(pg_admin):
    with fresh_database(pg_admin, prefix="flywheel_console_") as url:
        upgrade(url)
        engine = make_engine(url)
        with engine.begin() as conn:
            for statement in GENERATE:
                conn.execute(sa.text(statement))
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(sa.text("VACUUM ANALYZE"))
        yield url, engine
        engine.dispose()


@pytest.fixture(scope="module")
def settings(big_db, tmp_path_factory):
    url, _ = big_db
    data = tmp_path_factory.mktemp("console-scale")
    return load_settings(data_dir=str(data / "data"), db={"url": url}, model={"line": LINE},
                         store={"path": str(data / "store")}, bus={"kind": "local"},
                         gateway={"auth": "off", "upstream": "http://127.0.0.1:9"})


PAGES = ["/console", "/console/versions", f"/console/versions?before={VERSIONS // 2}", f"/console/versions/{VERSIONS // 2}",
         "/console/canary", "/console/sessions?tenant=tenant-3", "/console/sessions?q=sess-77777",
         "/console/session?tenant=tenant-7&id=sess-77777"]


def test_every_page_renders_in_under_300_ms_of_server_time(settings):
    timings = {}
    with TestClient(create_app(settings)) as client:
        for url in PAGES:
            assert client.get(url).status_code == 200, url  # warm: imports, first query plans
            runs = []
            for _ in range(5):
                r = client.get(url)
                assert r.status_code == 200, (url, r.text[:300])
                runs.append(float(r.headers["server-timing"].split("dur=")[1]))
            timings[url] = statistics.median(runs)
    print("console server time, median of 5 (ms):", {u: round(t, 1) for u, t in timings.items()})
    slow = {u: t for u, t in timings.items() if t >= BUDGET_MS}
    assert not slow, f"pages over {BUDGET_MS} ms: {slow}"
    page = TestClient(create_app(settings))
    with page as client:
        html = client.get(f"/console/versions/{VERSIONS // 2}").text
        assert "t-10000" in html and "sess-10000" in html  # trained trajectories link to their sessions
        assert f'id="stable-version"><a href="/console/versions/{VERSIONS - 2}">' in client.get("/console").text


def scans(plan: dict) -> list[str]:
    """The tables a plan reads with a sequential scan."""
    found = [plan["Relation Name"]] if plan.get("Node Type") == "Seq Scan" else []
    for child in plan.get("Plans", ()):
        found += scans(child)
    return found


def test_no_page_scans_a_large_table(big_db, settings):
    url, _ = big_db
    engine = make_engine(url)
    captured: list[tuple[str, object]] = []

    @sa.event.listens_for(engine, "before_cursor_execute")
    def _capture(_conn, _cursor, statement, parameters, _context, _many):  # noqa: ANN001
        if statement.lstrip().upper().startswith("SELECT"):
            captured.append((statement, parameters))

    sessions = make_session_factory(engine)
    none = lambda: None  # noqa: E731 (the recorded decision is fresh: no registry needed)
    pages.overview(settings, sessions, none, {"events": 0, "bytes": 0, "oldest_age_s": 0.0, "bus_up": True},
                   {"generations": 0, "feedback": 0, "rejected": 0}, {"stages": {}, "error": None})
    pages.versions(settings, sessions, None)
    pages.versions(settings, sessions, VERSIONS // 2)
    pages.version(settings, sessions, VERSIONS // 2)
    pages.canary(settings, sessions, none)
    pages.session_list(settings, sessions, "tenant-3", None)
    pages.session_list(settings, sessions, None, "sess-77777")
    pages.session(settings, sessions, "tenant-7", "sess-77777")
    assert len(captured) >= 20
    sa.event.remove(engine, "before_cursor_execute", _capture)
    bad, unindexed = {}, {}
    raw = engine.raw_connection()
    try:
        cursor = raw.cursor()
        cursor.execute("SELECT relname, reltuples FROM pg_class WHERE relkind = 'r'")
        large = {name for name, rows in cursor.fetchall() if rows >= LARGE_ROWS}
        assert {"generations", "sessions", "trajectories", "scored_trajectories", "feedback",
                "trained_trajectories"} <= large
        for statement, parameters in captured:
            cursor.execute("EXPLAIN (FORMAT JSON) " + statement, parameters)
            scanned = set(scans(cursor.fetchone()[0][0]["Plan"]))
            if scanned & large:
                bad[statement[:160]] = sorted(scanned & large)
            # With scans priced out, what is still scanned has no index that serves the query.
            cursor.execute("SET enable_seqscan = off")
            cursor.execute("EXPLAIN (FORMAT JSON) " + statement, parameters)
            forced = set(scans(cursor.fetchone()[0][0]["Plan"])) - SMALL_TABLES
            cursor.execute("SET enable_seqscan = on")
            if forced:
                unindexed[statement[:160]] = sorted(forced)
    finally:
        raw.close()
        engine.dispose()
    assert not bad, f"sequential scans of large tables: {bad}"
    assert not unindexed, f"queries no index serves: {unindexed}"
