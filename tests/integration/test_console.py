"""The operator console through the gateway app (SQLite and PostgreSQL): login, pages, forms, escaping.

A registry with real versions (tiny states, folder store), real ``generations``, ``feedback``,
``trajectories`` and ``scored_trajectories`` rows as ingest and rewards store them, and real API keys;
the gateway app under ``TestClient`` with ``gateway.auth = "on"`` (and off, for the loopback rule).
The browser tests (tests/e2e/test_console_browser.py) drive the same pages in Chromium.
"""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from fastapi.testclient import TestClient

from flywheel.db.models import Feedback, Generation, ScoredTrajectoryRow, SessionState, Trajectory
from flywheel.keys import create_key, revoke_key
from flywheel.settings import load_settings
from serving.gateway.app import create_app
from tests.integration.test_rollout_controller import (
    LINE,
    POLICY,
    publish,
    registry,  # noqa: F401 (the fixture)
    statuses,
)

pytestmark = pytest.mark.integration

HOSTILE_PROMPT = "<script>alert('pwned')</script> sort: b a"
HOSTILE_COMMENT = '<img src=x onerror="alert(1)">'


def settings_for(migrated_db_url, tmp_path, auth: str = "on"):
    return load_settings(data_dir=str(tmp_path / "data"), db={"url": migrated_db_url}, model={"line": LINE},
                         store={"path": str(tmp_path / "store")},
                         bus={"kind": "local", "topic_prefix": f"t{uuid.uuid4().hex[:8]}."},
                         gateway={"auth": auth, "upstream": "http://127.0.0.1:9"}, rollout=POLICY.model_dump())


def add_session(sessions, tenant: str, session_id: str, version: int, trajectory_id: str) -> str:
    """One served turn with hostile content, its feedback, the trajectory and its score."""
    now = datetime.now(UTC)
    gid = uuid.uuid4().hex
    with sessions() as db, db.begin():
        db.add(Generation(event_id=gid, generation_id=gid, tenant=tenant, session_id=session_id, model_line=LINE,
                          model_version=version, node_id="node-a", ts=now,
                          payload={"request": {"messages": [{"role": "user", "content": HOSTILE_PROMPT}]},
                                   "response": {"choices": [{"message": {"role": "assistant", "content": "a b"}}]},
                                   "latency_ms": 12.5, "finish_reason": "stop", "completion_token_ids": [1, 2]}))
        fid = uuid.uuid4().hex
        db.add(Feedback(event_id=fid, feedback_id=fid, tenant=tenant, session_id=session_id, generation_id=gid,
                        kind="explicit", signal="thumbs", value=-1.0, ts=now, state="joined",
                        payload={"comment": HOSTILE_COMMENT}))
        db.add(SessionState(tenant=tenant, session_id=session_id, status="closed", last_event_at=now, closed_at=now,
                            revision=0))
        db.add(Trajectory(trajectory_id=trajectory_id, revision=0, event_id=uuid.uuid4().hex, tenant=tenant,
                          session_id=session_id, model_line=LINE, closed_reason="outcome", ts=now, payload={}))
        db.add(ScoredTrajectoryRow(
            trajectory_id=trajectory_id, revision=0, reward_spec_version="spec-1", event_id=uuid.uuid4().hex,
            tenant=tenant, total_reward=-0.75, ts=now,
            payload={"turn_rewards": [-0.75], "reward_components": {"thumbs": -1.0, "clip": 0.25},
                     "held_out": False, "segments": [{"turns": [{"generation_id": gid}]}]}))
    return gid


@pytest.fixture
def console(registry, sessions, migrated_db_url, tmp_path):  # noqa: F811
    trajectory_id = f"traj-{uuid.uuid4().hex[:8]}"
    gid = add_session(sessions, "acme", "sess-1", 0, trajectory_id)
    v1 = publish(registry, {"trajectory_ids": [trajectory_id], "samples": 4, "tokens": 40, "parity": 0.01,
                            "staleness": {"0": 3, "1": 1}})
    v2 = publish(registry)
    admin_info, admin = create_key(sessions, "ops", role="admin", name="admin")
    _, tenant = create_key(sessions, "acme", name="acme")
    app = create_app(settings_for(migrated_db_url, tmp_path))
    with TestClient(app, base_url="http://testserver") as client:
        yield {"client": client, "admin": admin, "admin_id": admin_info.key_id, "tenant": tenant, "v1": v1, "v2": v2,
               "gid": gid, "trajectory_id": trajectory_id, "registry": registry, "sessions": sessions}


def login(client: TestClient, key: str):
    return client.post("/console/login", data={"key": key}, follow_redirects=False)


def csrf_of(html: str) -> str:
    match = re.search(r'name="csrf_token" value="([^"]+)"', html)
    assert match, "no CSRF token on the page"
    return match.group(1)


def test_pages_need_an_admin_login(console):
    client = console["client"]
    r = client.get("/console", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/console/login"
    assert client.get("/console/login").status_code == 200
    r = login(client, console["tenant"])
    assert r.status_code == 403 and "admin API key" in r.text and "flywheel_console" not in r.headers.get("set-cookie", "")
    r = login(client, "fwk_nothere_nothere")
    assert r.status_code == 401
    r = client.get("/console", headers={"Authorization": f"Bearer {console['tenant']}"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_required"
    r = login(client, console["admin"])
    assert r.status_code == 303
    cookie = r.headers["set-cookie"]
    assert "flywheel_console=" in cookie and "HttpOnly" in cookie and "SameSite=strict" in cookie.replace("Strict", "strict")
    assert "Path=/console" in cookie
    assert console["admin"] not in cookie


def test_every_page_renders_with_its_security_headers(console):
    client = console["client"]
    login(client, console["admin"])
    v1 = console["v1"]
    for url in ("/console", "/console/versions", f"/console/versions/{v1}", "/console/canary", "/console/sessions",
                "/console/sessions?q=sess-1", "/console/session?tenant=acme&id=sess-1", "/console?fragment=1"):
        r = client.get(url)
        assert r.status_code == 200, (url, r.text[:500])
        assert "script-src 'self'" in r.headers["content-security-policy"] and r.headers["x-frame-options"] == "DENY"
        assert re.match(r"app;dur=\d+(\.\d+)?", r.headers["server-timing"])
    overview = client.get("/console").text
    assert re.search(r'id="stable-version"><a href="/console/versions/0">v0</a>', overview)
    version = client.get(f"/console/versions/{v1}").text
    assert console["trajectory_id"] in version and "/console/session?tenant=acme&amp;id=sess-1" in version
    assert client.get("/console/versions/999").status_code == 404
    assert client.get("/console/versions?before=x").status_code == 400


def test_a_session_shows_its_turns_rewards_and_training_with_content_escaped(console):
    client = console["client"]
    login(client, console["admin"])
    html = client.get("/console/session?tenant=acme&id=sess-1").text
    assert "<script>alert" not in html and "&lt;script&gt;alert(&#39;pwned&#39;)&lt;/script&gt;" in html
    assert "<img src=x" not in html and "&lt;img src=x onerror=&#34;alert(1)&#34;&gt;" in html
    assert f'trained into <a href="/console/versions/{console["v1"]}">' in html
    assert "-0.75" in html and "clip" in html and "training slice" in html
    assert console["gid"] in html
    found = client.get("/console/sessions?q=sess-1").text
    assert "/console/session?tenant=acme&amp;id=sess-1" in found


def test_a_promote_from_the_canary_page_moves_the_version_and_is_audited(console):
    client, reg, v2 = console["client"], console["registry"], console["v2"]
    login(client, console["admin"])
    token = csrf_of(client.get("/console/canary").text)
    r = client.post("/console/canary/promote", data={"csrf_token": token, "version": str(v2), "reason": "ship it <b>"},
                    follow_redirects=False)
    assert r.status_code == 303 and "ok=" in r.headers["location"]
    assert statuses(reg)[v2] == "stable"
    reason = reg.transitions(v2)[-1]["reason"]
    assert reason == f"manual promote (was candidate): console: admin API key {console['admin_id']}: ship it <b>"
    page = client.get(r.headers["location"]).text
    assert f"promote v{v2}: v{v2} stable" in page
    versions = client.get("/console/versions").text
    assert "ship it &lt;b&gt;" in versions


def test_forged_posts_are_refused(console):
    client, reg, v2 = console["client"], console["registry"], console["v2"]
    before = statuses(reg)
    r = client.post("/console/canary/promote", data={"version": str(v2)}, follow_redirects=False)
    assert r.status_code == 403  # not logged in
    login(client, console["admin"])
    token = csrf_of(client.get("/console/canary").text)
    r = client.post("/console/canary/promote", data={"version": str(v2)}, follow_redirects=False)
    assert r.status_code == 403 and r.json()["error"]["code"] == "csrf_failed"
    r = client.post("/console/canary/promote", data={"version": str(v2), "csrf_token": "x" * len(token)},
                    follow_redirects=False)
    assert r.status_code == 403 and r.json()["error"]["code"] == "csrf_failed"
    r = client.post("/console/canary/promote", data={"version": str(v2), "csrf_token": token},
                    headers={"Origin": "https://evil.example"}, follow_redirects=False)
    assert r.status_code == 403 and r.json()["error"]["code"] == "csrf_failed"
    r = client.post("/console/canary/promote", content=f'{{"version": {v2}, "csrf_token": "{token}"}}',
                    headers={"Content-Type": "application/json"}, follow_redirects=False)
    assert r.status_code == 415
    assert statuses(reg) == before


def test_a_refused_action_is_shown_not_applied(console):
    client, reg = console["client"], console["registry"]
    login(client, console["admin"])
    token = csrf_of(client.get("/console/canary").text)
    r = client.post("/console/canary/clear", data={"csrf_token": token, "version": "0"})
    assert r.status_code == 200 and "clear refused" in r.text and statuses(reg)[0] == "stable"
    r = client.post("/console/canary/promote", data={"csrf_token": token, "version": "12345"})
    assert "version 12345 is not in the reg" in r.text


def test_a_revoked_key_ends_its_login_and_logout_ends_it_too(console):
    client, sessions = console["client"], console["sessions"]
    login(client, console["admin"])
    assert client.get("/console", follow_redirects=False).status_code == 200
    token = csrf_of(client.get("/console").text)
    r = client.post("/console/logout", data={"csrf_token": token}, follow_redirects=False)
    assert r.status_code == 303 and client.get("/console", follow_redirects=False).status_code == 303
    login(client, console["admin"])
    assert client.get("/console", follow_redirects=False).status_code == 200
    revoke_key(sessions, console["admin_id"])
    assert client.get("/console", follow_redirects=False).status_code == 303


def test_with_auth_off_loopback_callers_only(registry, sessions, migrated_db_url, tmp_path):  # noqa: F811
    settings = settings_for(migrated_db_url, tmp_path, auth="off")
    with TestClient(create_app(settings)) as client:
        r = client.get("/console")
        assert r.status_code == 200 and "flywheel_console=" in r.headers["set-cookie"]
        token = csrf_of(r.text)
        v1 = publish(registry)
        r = client.post("/console/canary/promote", data={"csrf_token": token, "version": str(v1)},
                        follow_redirects=False)
        assert r.status_code == 303 and statuses(registry)[v1] == "stable"
        assert "console (loopback testclient, gateway.auth off)" in registry.transitions(v1)[-1]["reason"]
    with TestClient(create_app(settings), client=("203.0.113.9", 5000)) as remote:
        r = remote.get("/console")
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_required"


def test_old_sessions_page_back_by_time(console):
    client, sessions = console["client"], console["sessions"]
    now = datetime.now(UTC)
    with sessions() as db, db.begin():
        for i in range(60):
            db.add(SessionState(tenant="acme", session_id=f"old-{i:02d}", status="closed",
                                last_event_at=now - timedelta(minutes=10 + i), closed_at=now, revision=0))
    login(client, console["admin"])
    html = client.get("/console/sessions?tenant=acme").text
    assert "sess-1" in html and "old-00" in html and "old-59" not in html  # the 50 most recent
    older = re.search(r'id="older" href="([^"]+)"', html).group(1).replace("&amp;", "&")
    html = client.get(older).text
    assert "old-59" in html and "old-00" not in html and "sess-1" not in html


def test_the_overview_shows_the_decision_the_rollout_role_recorded(console):
    from serving.rollout import Decision
    from serving.rollout_record import last_decision, record

    client, sessions = console["client"], console["sessions"]
    login(client, console["admin"])
    assert "evaluated now by the console (no decision of the rollout role recorded)" in client.get("/console").text
    figures = {"elapsed_s": 42.0, "canary": {"generations": 120, "negative": 3, "errors": 0, "latency_median_ms": 80.0,
                                             "latency_n": 120},
               "stable": {"generations": 130, "negative": 9, "errors": 1, "latency_median_ms": 85.0, "latency_n": 130},
               "tests": {"negative": {"statistic": -1.5, "p": 0.93}, "errors": {"statistic": -1.0, "p": 0.84}}}
    record(sessions, LINE, Decision("wait", console["v2"], "window 42/3600s; <i>not yet</i>", figures))
    record(sessions, LINE, Decision("wait", console["v2"], "window 43/3600s; <i>not yet</i>", figures))  # an upsert
    with sessions() as db:
        assert last_decision(db, LINE)["reason"].startswith("window 43/3600s")
    overview = client.get("/console").text
    assert "the rollout role&#39;s last tick; next tick in about" in overview
    assert "window 43/3600s; &lt;i&gt;not yet&lt;/i&gt;" in overview
    canary = client.get("/console/canary").text
    assert re.search(r"<th>canary</th><td>120</td><td>3</td>", canary)
    assert re.search(r"<td>negative</td><td>-1.5</td><td>0.93</td><td>not worse</td>", canary)
    v3 = publish(console["registry"])  # published after that tick: the console decides afresh
    overview = client.get("/console").text
    assert f"evaluated now by the console (v{v3} was published after the rollout role&#39;s last tick)" in overview


def test_the_canary_page_shows_the_promotion_gates_verdicts_escaped(console):
    from serving.rollout import Decision
    from serving.rollout_record import record

    client, sessions, v2 = console["client"], console["sessions"], console["v2"]
    login(client, console["admin"])
    assert 'id="evidence"' not in client.get("/console/canary").text  # a line without gates shows none
    since = datetime.now(UTC) - timedelta(minutes=5)
    verdicts = [
        {"metric": "solved", "role": "must_win", "outcome": "undecided", "effect": 0.05, "lower": -0.02, "upper": None,
         "p": 0.2, "n_canary": 120, "n_stable": 130, "mean_canary": 0.55, "mean_stable": 0.5, "reason": "r"},
        {"metric": "<b>latency</b>", "role": "must_not_lose", "outcome": "lose", "effect": -0.1, "lower": None,
         "upper": None, "p": 0.01, "n_canary": 3, "n_stable": 4, "mean_canary": None, "mean_stable": None,
         "reason": "<script>x</script>"}]
    figures = {"evidence": {"canary": v2, "since": since.isoformat(), "action": "<i>wait</i>", "reason": "waiting",
                            "verdicts": verdicts}}
    record(sessions, LINE, Decision("wait", v2, "waiting (300s of max window 3600s)", figures))
    html = client.get("/console/canary").text
    assert f"evidence on v{v2} since 5 min ago: &lt;i&gt;wait&lt;/i&gt;" in html
    assert re.search(r"<td>solved</td><td>must_win</td><td><span class=\"tag\">undecided</span></td><td>0.05</td>"
                     r"<td>\[-0.02, \+inf\]</td><td>0.2</td><td>120 / 130</td><td>0.55 / 0.5</td>", html)
    assert re.search(r"<td>&lt;b&gt;latency&lt;/b&gt;</td><td>must_not_lose</td><td><span class=\"tag error\">lose"
                     r"</span></td><td>-0.1</td><td>\[-inf, \+inf\]</td><td>0.01</td><td>3 / 4</td><td>- / -</td>", html)
    assert "<b>latency" not in html and "<i>wait" not in html and "<script>x" not in html


def test_a_version_page_shows_what_it_observed_of_each_product_metric(console):
    client, sessions, v1, v2 = console["client"], console["sessions"], console["v1"], console["v2"]
    gid = add_session(sessions, "acme", "sess-2", v1, f"traj-{uuid.uuid4().hex[:8]}")  # thumbs -1 on v1
    now = datetime.now(UTC)
    with sessions() as db, db.begin():
        for kind, signal, value, generation_id in (("outcome", "task_solved", 1.0, None), ("implicit", "retry", None, gid)):
            fid = uuid.uuid4().hex
            db.add(Feedback(event_id=fid, feedback_id=fid, tenant="acme", session_id="sess-2", generation_id=generation_id,
                            kind=kind, signal=signal, value=value, ts=now, state="joined", payload={}))
    login(client, console["admin"])
    row = "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>"
    v0 = client.get("/console/versions/0").text
    assert row.format("thumbs", "float", "generation", "higher", 1, -1) in v0
    assert "task_solved" not in v0 and ">retry<" not in v0  # reported on v1 only
    page = client.get(f"/console/versions/{v1}").text
    table = page.split('id="product-metrics"')[1].split("</table>")[0]
    assert row.format("thumbs", "float", "generation", "higher", 1, -1) in table
    assert row.format("retry", "boolean", "generation", "lower", 1, 1) in table
    assert row.format("task_solved", "float", "session", "higher", 1, 1) in table
    assert table.count("<tr><td>") == 3  # what nobody reported (rating, edits, abandon...) is left out
    assert f"no feedback reports a product metric on v{v2}" in client.get(f"/console/versions/{v2}").text
