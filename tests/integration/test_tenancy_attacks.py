"""Attacks on tenancy against a running gateway (auth on, real HTTP, uvicorn in a thread) in front
of an upstream that serves whatever version it is asked for, on SQLite + in-process state and on
PostgreSQL + Redis: cross-tenant feedback, session steering, replayed revoked keys, forged keys,
admin routes without the admin key, rate limits, and what reaches the logs."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

from bench.upstream import CannedUpstream
from flywheel.db.models import Generation, ModelVersion
from flywheel.db.session import make_engine, make_session_factory, upgrade
from flywheel.events import FeedbackEvent, GenerationEvent
from flywheel.keys import create_key, revoke_key
from flywheel.settings import Settings, load_settings
from serving.gateway.app import create_app
from serving.server import bind, serve
from testbed.procs import free_port
from tests.fixtures.roles import drain_capture, wait_until

pytestmark = pytest.mark.integration

CHAT = "/v1/chat/completions"
FEEDBACK = "/v1/feedback"
KEY_CACHE_S = 0.5


class VersionEchoUpstream(CannedUpstream):
    """Serves the version the gateway asks for (``X-Flywheel-Model-Version``, default 1) and keeps
    what every request carried: ``(session header, version header)``."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str | None, str | None]] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
                method, path, _ = head[0].split(" ", 2)
                headers = {}
                for line in head[1:]:
                    name, _, value = line.partition(":")
                    headers[name.strip().lower()] = value.strip()
                length = int(headers.get("content-length") or 0)
                body = await reader.readexactly(length) if length else b""
                asked = headers.get("x-flywheel-model-version")
                if path != "/v1/models":
                    self.seen.append((headers.get("x-flywheel-session"), asked))
                self.version = int(asked) if asked else 1  # respond() reads it before its first await
                await self.respond(method, path, body, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@contextmanager
def running(upstream: Any) -> Iterator[tuple[Any, str]]:
    """``upstream`` (a ``bench.upstream.CannedUpstream``) serving on a free port in a thread, and its URL."""
    port = free_port()
    loop, started = asyncio.new_event_loop(), threading.Event()
    stop = asyncio.Event()
    thread = threading.Thread(target=loop.run_until_complete,
                              args=(upstream.serve("127.0.0.1", port, started, stop),), daemon=True)
    thread.start()
    assert started.wait(10), "upstream did not start"
    try:
        yield upstream, f"http://127.0.0.1:{port}"
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(5)


@dataclass
class Env:
    url: str
    settings: Settings
    sessions: Any
    upstream: VersionEchoUpstream
    keys: dict[str, str] = field(default_factory=dict)  # acme, evil (tenants), admin
    key_ids: dict[str, str] = field(default_factory=dict)

    def client(self, key: str | None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)

    def as_(self, who: str) -> httpx.Client:
        return self.client(self.keys[who])

    def new_key(self, tenant: str, **kwargs: Any) -> tuple[str, str]:
        info, key = create_key(self.sessions, tenant, **kwargs)
        return info.key_id, key

    def drain(self) -> dict[str, list[bytes]]:
        """Everything on the bus once the gateway's spool has shipped what it holds."""
        with self.as_("admin") as admin:
            return drain_capture(admin, self.settings)

    def feedback_events(self) -> list[FeedbackEvent]:
        return [FeedbackEvent.from_bytes(v) for v in self.drain()[self.settings.topic("feedback")]]


@pytest.fixture(params=[("sqlite", "memory"), ("postgresql", "redis")], ids=["sqlite+memory", "postgresql+redis"])
def env(request: pytest.FixtureRequest, tmp_path, caplog) -> Iterator[Env]:
    caplog.set_level(logging.INFO)  # the default level of `flywheel gateway`, from start-up on
    db, live = request.param
    db_url = request.getfixturevalue("sqlite_url" if db == "sqlite" else "pg_url")
    live_settings: dict[str, Any] = {"kind": live}
    if live == "redis":
        live_settings |= {"redis_url": request.getfixturevalue("redis_url"),
                          "key_prefix": request.getfixturevalue("live_prefix")}
    with running(VersionEchoUpstream()) as (upstream, upstream_url):
        settings = load_settings(
            data_dir=str(tmp_path / "data"),
            bus={"kind": "local", "partitions": 2, "topic_prefix": "t."},
            db={"url": db_url},
            live=live_settings,
            gateway={"auth": "on", "upstream": upstream_url, "key_cache_s": KEY_CACHE_S,
                     "rate_limit_rpm": 0, "rate_limit_burst": 0},
        )
        upgrade(db_url)
        engine = make_engine(db_url)
        sessions = make_session_factory(engine)
        with sessions() as session:  # versions admins may pin (candidates: routing still has no stable)
            session.add_all(ModelVersion(model_line=settings.model.line, version=v, kind="full", parent=None,
                                         sha256="0" * 64, store_key=f"v{v}", bytes=1, full_bytes=1,
                                         status="candidate", created_at=datetime.now(UTC))
                            for v in range(10))
            session.commit()
        sock = bind("127.0.0.1", 0)
        environment = Env(f"http://127.0.0.1:{sock.getsockname()[1]}", settings, sessions, upstream)
        for who, tenant, role in (("acme", "acme", "tenant"), ("evil", "evil", "tenant"), ("admin", "ops", "admin")):
            environment.key_ids[who], environment.keys[who] = environment.new_key(tenant, role=role, name=who)
        stop, ready = threading.Event(), threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            try:
                serve(create_app(settings), host="127.0.0.1", port=0, sock=sock, stop=stop, ready=ready,
                      log_level=settings.log_level)
            except BaseException as exc:  # surfaced below; a thread cannot raise into the test
                errors.append(exc)

        thread = threading.Thread(target=run, name="gateway", daemon=True)
        thread.start()
        try:
            wait_until("the gateway to start", lambda: ready.is_set() or errors or not thread.is_alive(), timeout_s=60)
            assert ready.is_set() and not errors, f"gateway did not start: {errors}"
            yield environment
        finally:
            stop.set()
            thread.join(30)
            engine.dispose()
        assert not errors, errors


def _chat(client: httpx.Client, session: str, content: str = "sort 3 1 2", **extra: Any) -> httpx.Response:
    return client.post(CHAT, json={"messages": [{"role": "user", "content": content}], **extra},
                       headers={"X-Flywheel-Session": session})


def _thumbs(feedback_id: str, **target: Any) -> dict[str, Any]:
    return {"feedback_id": feedback_id, "kind": "explicit", "signal": "thumbs", "value": 1, **target}


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_feedback_on_another_tenants_generation_or_session_is_404_and_never_captured(env):
    acme_session = f"acme-{uuid.uuid4().hex}"
    with env.as_("acme") as acme, env.as_("evil") as evil:
        r = _chat(acme, acme_session)
        assert r.status_code == 200, r.text
        generation = r.headers["X-Flywheel-Generation"]
        # An older generation of acme's, known only to the database (expired from live state).
        archived_session, archived = f"acme-old-{uuid.uuid4().hex}", uuid.uuid4().hex
        with env.sessions() as s:
            s.add(Generation(event_id=uuid.uuid4().hex, generation_id=archived, tenant="acme",
                             session_id=archived_session, model_line="tiny-sim", model_version=1, node_id="n",
                             ts=datetime.now(UTC), payload={}))
            s.commit()
        missing = uuid.uuid4().hex

        attacks = {
            "generation": (_thumbs("x1", generation_id=generation), {}),
            "generation + its session": (_thumbs("x2", generation_id=generation, session_id=acme_session), {}),
            "generation + session header": (_thumbs("x3", generation_id=generation),
                                            {"X-Flywheel-Session": acme_session}),
            "archived generation": (_thumbs("x4", generation_id=archived), {}),
            "session": (_thumbs("x5", session_id=acme_session), {}),
            "session header": (_thumbs("x6"), {"X-Flywheel-Session": acme_session}),
            "archived session": (_thumbs("x7", session_id=archived_session), {}),
        }
        for name, (body, headers) in attacks.items():
            err = _error(evil.post(FEEDBACK, json=body, headers=headers), 404)
            assert err["code"] in ("generation_not_found", "session_not_found"), name
        # A batch with one legitimate-looking item and one attack is refused whole.
        batch = {"feedback": [_thumbs("x8", session_id=acme_session), _thumbs("x9", generation_id=generation)]}
        assert _error(evil.post(FEEDBACK, json=batch), 404)["param"] == "feedback.0.session_id"

        # The same answers as for ids that never existed: nothing tells evil that acme's exist.
        for mine, never in ((_thumbs("y1", generation_id=generation), _thumbs("y1", generation_id=missing)),
                            (_thumbs("y2", session_id=acme_session), _thumbs("y2", session_id=missing))):
            theirs, nothing = _error(evil.post(FEEDBACK, json=mine), 404), _error(evil.post(FEEDBACK, json=never), 404)
            target = mine.get("generation_id") or mine["session_id"]
            other = never.get("generation_id") or never["session_id"]
            assert theirs == {**nothing, "message": nothing["message"].replace(other, target)}

        # The owner can: control for the 404s above.
        assert acme.post(FEEDBACK, json=_thumbs("ok-1", generation_id=generation)).status_code == 202
        assert acme.post(FEEDBACK, json=_thumbs("ok-2", generation_id=archived)).status_code == 202
        assert acme.post(FEEDBACK, json=_thumbs("ok-3", session_id=acme_session)).status_code == 202

    events = env.feedback_events()
    assert sorted(e.feedback_id for e in events) == ["ok-1", "ok-2", "ok-3"]
    assert {e.tenant for e in events} == {"acme"}
    assert {(e.feedback_id, e.session_id) for e in events} == {
        ("ok-1", acme_session), ("ok-2", archived_session), ("ok-3", acme_session)}


def test_reusing_another_tenants_session_id_gets_a_separate_session(env):
    shared = f"shared-{uuid.uuid4().hex}"
    with env.as_("admin") as admin:
        assert admin.put("/admin/pins/acme", json={"version": 3}).status_code == 200
        assert admin.put("/admin/pins/evil", json={"version": 5}).status_code == 200
    with env.as_("acme") as acme, env.as_("evil") as evil:
        first = _chat(acme, shared)
        assert first.status_code == 200 and first.headers["X-Flywheel-Model-Version"] == "3"
        # evil sends acme's session id: it gets a session of its own, on evil's version.
        steer = _chat(evil, shared)
        assert steer.status_code == 200 and steer.headers["X-Flywheel-Model-Version"] == "5"
        assert acme.post(FEEDBACK, json=_thumbs("acme-1", session_id=shared)).status_code == 202
        assert evil.post(FEEDBACK, json=_thumbs("evil-1", session_id=shared)).status_code == 202
        # evil's feedback on its own generation cannot be pointed at acme's session by naming it.
        theirs = steer.headers["X-Flywheel-Generation"]
        assert evil.post(FEEDBACK, json=_thumbs("evil-2", generation_id=theirs, session_id=shared)).status_code == 202
        # acme's session is where it was: same version, whatever evil did.
        again = _chat(acme, shared)
        assert again.headers["X-Flywheel-Model-Version"] == "3"
        assert _error(evil.post(FEEDBACK, json=_thumbs("evil-3", generation_id=first.headers["X-Flywheel-Generation"])),
                      404)["code"] == "generation_not_found"
    assert [v for s, v in env.upstream.seen if s == shared] == ["3", "5", "3"]

    seen = env.drain()
    generations = [GenerationEvent.from_bytes(v) for v in seen[env.settings.topic("generations")]]
    assert sorted((g.tenant, g.model_version) for g in generations if g.session_id == shared) == [
        ("acme", 3), ("acme", 3), ("evil", 5)]
    feedback = [FeedbackEvent.from_bytes(v) for v in seen[env.settings.topic("feedback")]]
    assert {(f.feedback_id, f.tenant) for f in feedback} == {("acme-1", "acme"), ("evil-1", "evil"), ("evil-2", "evil")}


def test_revoked_keys_stay_refused_when_replayed(env):
    key_id, key = env.new_key("acme", name="soon revoked")
    with env.client(key) as client:
        assert _chat(client, "s-revoke").status_code == 200
        assert revoke_key(env.sessions, key_id).revoked_at is not None
        wait_until("the revocation to take effect", lambda: _chat(client, "s-revoke").status_code == 401,
                   timeout_s=KEY_CACHE_S + 2, every_s=0.05)
        served = env.upstream.served
        for _ in range(5):  # replayed, on every route
            assert _error(_chat(client, "s-revoke"), 401)["code"] == "invalid_api_key"
            assert _error(client.post(FEEDBACK, json=_thumbs("r", session_id="s-revoke")), 401)["code"] == "invalid_api_key"
            assert client.get("/v1/models").status_code == 401
        assert env.upstream.served == served
    # Other keys of the tenant are unaffected.
    with env.as_("acme") as acme:
        assert _chat(acme, "s-other").status_code == 200
    assert [e.feedback_id for e in env.feedback_events()] == []


def test_forged_and_malformed_keys_are_refused_alike(env):
    acme, admin = env.keys["acme"], env.keys["admin"]
    acme_secret, admin_id = acme.rsplit("_", 1)[1], env.key_ids["admin"]
    flipped = acme[:-1] + ("0" if acme[-1] != "0" else "1")
    forged = {
        "no header": None,
        "wrong secret for a real key id": flipped,
        "admin key id with a tenant's secret": f"fwk_{admin_id}_{acme_secret}",
        "unknown key id": f"fwk_{uuid.uuid4().hex[:12]}_{acme_secret}",
        "openai-style key": "sk-proj-" + uuid.uuid4().hex,
        "truncated": acme[:-1],
        "padded": acme + "0",
        "upper case": acme.upper(),
    }
    served = env.upstream.served
    bodies = set()
    for name, key in forged.items():
        with env.client(key) as client:
            for response in (_chat(client, "s-forge"), client.post(FEEDBACK, json=_thumbs("f", session_id="s-forge")),
                             client.get("/admin/capture"), client.get("/v1/models")):
                err = _error(response, 401)
                assert err["code"] == "invalid_api_key", name
                assert acme_secret not in response.text and admin.rsplit("_", 1)[1] not in response.text
                bodies.add(json.dumps(err, sort_keys=True))
    with httpx.Client(base_url=env.url, timeout=30) as raw:
        for header in (f"Basic {acme}", acme, f"Token {acme}", "Bearer", f"Bearer{acme}"):
            bodies.add(json.dumps(_error(raw.post(CHAT, json={"messages": []}, headers={"Authorization": header}), 401),
                                  sort_keys=True))
    assert len(bodies) == 1, bodies
    assert env.upstream.served == served
    seen = env.drain()
    assert seen[env.settings.topic("generations")] == [] and seen[env.settings.topic("feedback")] == []


def test_admin_routes_need_the_admin_key(env):
    routes = [("GET", "/admin/capture", None), ("GET", "/admin/pins", None),
              ("PUT", "/admin/pins/acme", {"version": 9}), ("PUT", "/admin/pins/evil", {"version": None}),
              ("GET", "/admin/versions", None), ("POST", "/admin/versions/3/promote", None),
              ("POST", "/admin/versions/0/rollback", None), ("POST", "/admin/versions/3/pin", {"reason": "mine now"}),
              ("POST", "/admin/versions/3/pin", None), ("POST", "/admin/unpin", None),
              ("POST", "/admin/unpin", {"reason": "let me promote"})]
    with env.as_("admin") as admin:
        assert admin.put("/admin/pins/evil", json={"version": 2}).status_code == 200
    for method, path, body in routes:
        with env.client(None) as anonymous:
            assert _error(anonymous.request(method, path, json=body), 401)["code"] == "invalid_api_key"
        for tenant in ("acme", "evil"):
            with env.as_(tenant) as client:
                err = _error(client.request(method, path, json=body), 403)
                assert err["code"] == "admin_required" and err["type"] == "permission_error"
    with env.as_("admin") as admin:
        assert admin.get("/admin/pins").json() == {"pins": {"evil": 2}}  # no refused PUT changed anything
        listed = admin.get("/admin/versions").json()
        statuses = {v["version"]: v["status"] for v in listed["versions"]}
        assert "stable" not in statuses.values()  # no refused promote or pin changed anything
        assert listed["pin"] is None
        # The admin gets past auth to the registry's own answers: v3's weights are not in the store
        # (so it cannot be pinned: nothing unverifiable is pinned), and nothing is pinned to lift.
        err = _error(admin.post("/admin/versions/3/pin", json={"reason": "try"}), 409)
        assert err["code"] == "rollout_conflict" and "cannot pin v3" in err["message"]
        assert _error(admin.post("/admin/unpin"), 409)["code"] == "not_pinned"
        assert _error(admin.post("/admin/versions/99/pin"), 404)["code"] == "version_not_found"
        assert _error(admin.post("/admin/versions/3/pin", json={"reason": 5}), 400)["param"] == "reason"
        assert admin.get("/admin/versions").json()["pin"] is None
        assert admin.get("/admin/capture").status_code == 200
    # A revoked admin key is just another refused key.
    admin_id, admin_key = env.new_key("ops", role="admin")
    with env.client(admin_key) as second:
        assert second.get("/admin/pins").status_code == 200
        revoke_key(env.sessions, admin_id)
        wait_until("the admin key to be refused", lambda: second.get("/admin/pins").status_code == 401,
                   timeout_s=KEY_CACHE_S + 2, every_s=0.05)


def test_rate_limit_answers_429_with_retry_after(env):
    _, limited = env.new_key("acme", rpm=12)  # burst 0: ceil(12 / 6) = 2 at once, then one per 5 s
    with env.client(limited) as client, env.as_("acme") as unlimited:
        served = env.upstream.served
        assert [_chat(client, "s-rl").status_code for _ in range(2)] == [200, 200]
        refused = _chat(client, "s-rl")
        err = _error(refused, 429)
        assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded"
        assert 1 <= int(refused.headers["Retry-After"]) <= 5
        # Feedback spends the same budget; another key of the same tenant has its own.
        assert _error(client.post(FEEDBACK, json=_thumbs("rl", session_id="s-rl")), 429)["code"] == "rate_limit_exceeded"
        assert all(_chat(unlimited, "s-free").status_code == 200 for _ in range(10))
        assert env.upstream.served == served + 2 + 10
    seen = env.drain()
    assert seen[env.settings.topic("feedback")] == []
    assert len(seen[env.settings.topic("generations")]) == 12


def test_keys_and_prompts_never_reach_the_logs(env, caplog):
    marker = f"PROMPT-{uuid.uuid4().hex}"
    comment = f"COMMENT-{uuid.uuid4().hex}"
    revoked_id, revoked = env.new_key("acme")
    _, limited = env.new_key("acme", rpm=6)
    secrets = [env.keys["acme"], env.keys["evil"], env.keys["admin"], revoked, limited]
    with env.as_("acme") as acme, env.as_("evil") as evil, env.client(revoked) as old, env.client(limited) as slow:
        ok = _chat(acme, "s-log", marker)
        assert ok.status_code == 200
        stream = acme.post(CHAT, json={"messages": [{"role": "user", "content": marker}], "stream": True},
                           headers={"X-Flywheel-Session": "s-log"})
        assert stream.status_code == 200 and "[DONE]" in stream.text
        assert acme.post("/v1/completions", json={"prompt": marker}).status_code == 200
        assert acme.post(FEEDBACK, json=_thumbs("c1", session_id="s-log") | {"comment": comment}).status_code == 202
        # Every refusal path, carrying the prompt and the keys.
        assert _chat(evil, "s-log", marker, temperature="hot").status_code == 400
        assert acme.post(CHAT, content=b'{"messages": [{"content": "' + marker.encode() + b'"',
                         headers={"content-type": "application/json"}).status_code == 400
        assert evil.post(FEEDBACK, json=_thumbs("c2", generation_id=ok.headers["X-Flywheel-Generation"],
                                                comment=comment)).status_code == 404
        revoke_key(env.sessions, revoked_id)
        wait_until("revocation", lambda: _chat(old, "s-log", marker).status_code == 401, timeout_s=KEY_CACHE_S + 2)
        acme_key = env.keys["acme"]
        with env.client(acme_key[:-1] + ("0" if acme_key[-1] != "0" else "1")) as forged:
            assert _chat(forged, "s-log", marker).status_code == 401
        assert [_chat(slow, "s-log", marker).status_code for _ in range(2)] == [200, 429]
        assert evil.get("/admin/pins").status_code == 403
    env.drain()

    formatter = logging.Formatter("%(name)s %(levelname)s %(message)s")
    records = caplog.get_records("setup") + caplog.get_records("call")
    text = "\n".join(formatter.format(r) for r in records if r.levelno >= logging.INFO)
    assert "Application startup complete" in text, "the server thread's INFO logs must be captured"
    assert marker not in text and comment not in text
    for key in secrets:
        assert key not in text and key.rsplit("_", 1)[1] not in text
