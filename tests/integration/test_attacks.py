"""Attacks tried for real: one gateway per module served by its own entry point (uvicorn, auth on,
PostgreSQL + Redis, both URLs carrying passwords), the built-in node's HTTP app, the weight store on
disk and in S3 (moto's server), the ``flywheel`` command line and the ingest and rewards workers.
Tenancy attacks on feedback, forged and revoked keys, admin routes without the admin key and rate
limits live in test_tenancy_attacks.py; docs/security.md lists every attack, its test and answer.

Every parameter that reaches the database, tried with SQL payloads (``PAYLOADS``):
- gateway HTTP: the bearer key (its key id is looked up); ``X-Flywheel-Session`` on completions
  (live state, then the generations and sessions tables through ingest) and on feedback (the
  ownership query); the feedback body's ``session_id`` and ``generation_id`` (ownership queries) and
  ``feedback_id``, ``signal``, ``comment``, ``data`` (feedback rows); ``PUT /admin/pins/{tenant}``
  (the tenant, and the body's ``version``: a registry query); ``POST /admin/versions/{version}/
  {action}`` (both path parameters, and the body's ``reason``: audited transition rows).
- command line: ``keys create --tenant/--name``, ``keys list --tenant``, ``keys revoke KEY_ID``,
  ``rollout promote [LINE:]V`` and ``--reason``, ``rewards report --spec-version``.
- consumers: ingest (tenant, session, generation and feedback ids, signal, comment from events) and
  rewards (the trajectories' sessions), fed through the gateway and the bus into PostgreSQL.
Each payload is refused by validation (a 4xx or exit status 2 naming the problem) or stored and
matched as the literal text; the tables and the keys are intact afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import io
import ipaddress
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import httpx
import pytest
from sqlalchemy import func, inspect, make_url, select, text

from flywheel.db.models import ApiKey, Feedback, Generation, ModelVersion, Trajectory, VersionTransition
from flywheel.db.session import make_engine, make_session_factory, upgrade
from flywheel.events import FeedbackEvent, GenerationEvent
from flywheel.keys import create_key
from flywheel.settings import Settings, load_settings
from testbed.postgres import fresh_database
from testbed.procs import free_port
from tests.fixtures.roles import RoleThread, drain_capture, raw_exchange, served_app, wait_until
from tests.integration.test_store_s3 import BUCKET, s3, s3_endpoint  # noqa: F401  (moto fixtures)
from tests.integration.test_tenancy_attacks import VersionEchoUpstream, running

pytestmark = pytest.mark.integration

CHAT, COMPLETIONS, FEEDBACK = "/v1/chat/completions", "/v1/completions", "/v1/feedback"
#: Short read deadlines, so slow clients are cut off quickly here (defaults: 10 s and 30 s).
HEADER_TIMEOUT_S = BODY_TIMEOUT_S = 1.0
#: Secrets in the module gateway's settings; the test database trusts any password, Redis has none.
DB_SECRET = f"dbpw-{uuid.uuid4().hex}"
REDIS_SECRET = f"redispw-{uuid.uuid4().hex}"

PAYLOADS = [
    "' OR '1'='1",
    "'; DROP TABLE api_keys; --",
    "1; DELETE FROM model_versions WHERE '1'='1",
    '" OR ""="',
    "x') UNION SELECT key_sha256, tenant FROM api_keys --",
    "%' OR 1=1 --",
    "\\'; TRUNCATE sessions CASCADE; --",
    "\u01c5 \uff53\uff45\uff4c\uff45\uff43\uff54 \U0001f642 \u202e",
    "a\x00b",
]


def _printable(payload: str) -> bool:
    return not any(ord(c) < 32 or ord(c) == 127 for c in payload)


# The module's stack ----------------------------------------------------------------------------


@dataclass
class Stack:
    url: str
    settings: Settings
    sessions: Any
    upstream: VersionEchoUpstream
    config: Path  # the settings as a file, for `flywheel --config` calls
    tables: set[str]
    keys: dict[str, str] = field(default_factory=dict)  # acme, evil (tenants), admin
    key_ids: dict[str, str] = field(default_factory=dict)

    def client(self, who: str | None = None, **headers: Any) -> httpx.Client:
        auth = {"Authorization": f"Bearer {self.keys[who]}"} if who else {}
        return httpx.Client(base_url=self.url, headers={**auth, **headers}, timeout=20)

    @property
    def address(self) -> tuple[str, int]:
        parts = urlsplit(self.url)
        return parts.hostname or "", parts.port or 0

    def drain(self) -> dict[str, list[bytes]]:
        """Everything on the bus once the gateway's spool has shipped what it holds."""
        with self.client("admin") as admin:
            return drain_capture(admin, self.settings)

    def assert_intact(self) -> None:
        """Every table is still there, the keys still work, the line still has its ten versions."""
        with self.sessions() as db:
            assert set(inspect(db.get_bind()).get_table_names()) == self.tables
            keys = {k.key_id: k for k in db.scalars(select(ApiKey))}
            versions = db.scalar(select(func.count()).select_from(ModelVersion)
                                 .where(ModelVersion.model_line == self.settings.model.line))
        assert all(keys[k].revoked_at is None for k in self.key_ids.values())
        assert versions == 10
        with self.client("acme") as acme:
            assert acme.get("/v1/models").status_code == 200


@pytest.fixture(scope="module")
def module_db(pg_admin) -> Iterator[str]:
    """A PostgreSQL database for the module; its URL carries a password (trust auth ignores it)."""
    with fresh_database(pg_admin) as url:
        yield make_url(url).set(password=DB_SECRET).render_as_string(hide_password=False)


@pytest.fixture(scope="module")
def stack(module_db: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    import redis

    from serving.gateway.main import run as gateway_run

    root = tmp_path_factory.mktemp("attacks")
    prefix = f"flywheel_t_{uuid.uuid4().hex[:16]}:"
    with running(VersionEchoUpstream()) as (upstream, upstream_url):
        port = free_port()
        settings = load_settings(
            data_dir=str(root / "data"),
            log_level="INFO",
            bus={"kind": "local", "partitions": 2, "topic_prefix": "atk."},
            db={"url": module_db, "wait_s": 10},
            live={"kind": "redis", "redis_url": f"redis://:{REDIS_SECRET}@127.0.0.1:6379/0", "key_prefix": prefix},
            gateway={"auth": "on", "upstream": upstream_url, "port": port, "key_cache_s": 0.5,
                     "header_read_timeout_s": HEADER_TIMEOUT_S, "body_read_timeout_s": BODY_TIMEOUT_S},
            node={"body_read_timeout_s": BODY_TIMEOUT_S},
            ingest={"inactivity_timeout_s": 1.0},
            # Hostile custom signal names must still reach the database as literal values (below):
            # undeclared custom signals are accepted unchecked, as before declared metrics.
            metrics={"undeclared_custom": "accept"},
        )
        config = root / "settings.json"
        config.write_text(json.dumps(settings.model_dump(mode="json")))
        upgrade(module_db)
        engine = make_engine(module_db)
        sessions = make_session_factory(engine)
        with sessions() as db:  # versions admins may pin and promote (no weights: routing only)
            db.add_all(ModelVersion(model_line=settings.model.line, version=v, kind="full", parent=None,
                                    sha256="0" * 64, store_key=f"{settings.model.line}/v{v}", bytes=1,
                                    full_bytes=1, status="candidate", created_at=datetime.now(UTC))
                       for v in range(10))
            db.commit()
            tables = set(inspect(engine).get_table_names())
        environment = Stack(f"http://127.0.0.1:{port}", settings, sessions, upstream, config, tables)
        for who, tenant, role in (("acme", "acme", "tenant"), ("evil", "evil", "tenant"), ("admin", "ops", "admin")):
            info, key = create_key(sessions, tenant, role=role, name=who)
            environment.key_ids[who], environment.keys[who] = info.key_id, key
        switch, thresholds = sys.getswitchinterval(), gc.get_threshold()
        stop = threading.Event()
        thread = RoleThread("gateway", gateway_run, settings, stop)  # the real entry point: settings -> serve
        thread.start()
        try:
            wait_until("the gateway to serve", lambda: thread.error or httpx.get(f"{environment.url}/health",
                                                                               timeout=2).status_code == 200)
            assert thread.error is None, thread.error
            yield environment
        finally:
            stop.set()
            thread.join(30)
            sys.setswitchinterval(switch)  # the entry point tunes these for a serving process
            gc.set_threshold(*thresholds)
            gc.unfreeze()
            engine.dispose()
            client = redis.Redis.from_url(redis_url)
            keys = list(client.scan_iter(match=f"{prefix}*", count=500))
            if keys:
                client.delete(*keys)
            client.close()


def _chat(client: httpx.Client, session: str | bytes | None = None, content: str = "sort 3 1 2",
          **extra: Any) -> httpx.Response:
    headers = {"X-Flywheel-Session": session} if session is not None else {}
    return client.post(CHAT, json={"messages": [{"role": "user", "content": content}], **extra}, headers=headers)


def _thumbs(feedback_id: str, **target: Any) -> dict[str, Any]:
    return {"feedback_id": feedback_id, "kind": "explicit", "signal": "thumbs", "value": 1, **target}


def _error(response: httpx.Response, *statuses: int) -> dict[str, Any]:
    assert response.status_code in statuses, (response.status_code, response.text[:500])
    return response.json()["error"]


def _log_text(caplog: pytest.LogCaptureFixture) -> str:
    formatter = logging.Formatter("%(name)s %(levelname)s %(message)s")
    return "\n".join(formatter.format(r) for r in caplog.get_records("setup") + caplog.get_records("call"))


# Cross-tenant reads ----------------------------------------------------------------------------


def test_no_route_or_header_lets_a_tenant_read_or_steer_another_tenants_data(stack: Stack, caplog) -> None:
    marker, acme_session = f"PROMPT-{uuid.uuid4().hex}", f"acme-{uuid.uuid4().hex}"
    with stack.client("admin") as admin:
        assert admin.put("/admin/pins/acme", json={"version": 3}).status_code == 200
    with stack.client("acme") as acme, stack.client("evil") as evil, httpx.Client(base_url=stack.url) as anonymous:
        mine = _chat(acme, acme_session, marker)
        assert mine.status_code == 200 and mine.headers["X-Flywheel-Model-Version"] == "3", mine.text
        generation = mine.headers["X-Flywheel-Generation"]
        baseline = _chat(evil, f"evil-{uuid.uuid4().hex}").headers["X-Flywheel-Model-Version"]
        assert baseline != "3"

        # Every route that answers data, to a tenant key and to nobody: nothing of acme's.
        acme_things = ["acme", acme_session, generation, marker, stack.key_ids["acme"], stack.key_ids["admin"],
                       DB_SECRET, REDIS_SECRET]
        for client, path in ((evil, "/v1/models"), (anonymous, "/health"), (anonymous, "/metrics"),
                             (evil, "/health"), (evil, "/metrics")):
            response = client.get(path)
            assert response.status_code == 200, (path, response.text)
            assert not [t for t in acme_things if t in response.text], path
        for path in ("/admin/pins", "/admin/versions", "/admin/capture"):  # the admin reads (their 403s: tenancy)
            assert _error(evil.get(path), 403)["code"] == "admin_required"

        # Headers and body fields naming acme's session, generation, version or tenant steer nothing.
        steer = evil.post(CHAT, json={"messages": [{"role": "user", "content": "x"}], "model_version": 3,
                                      "session_id": acme_session, "tenant": "acme", "user": "acme"},
                          headers={"X-Flywheel-Session": acme_session, "X-Flywheel-Model-Version": "3",
                                   "X-Flywheel-Generation": generation, "X-Flywheel-Node": "canned",
                                   "X-Flywheel-Tenant": "acme", "X-Forwarded-For": "127.0.0.1"})
        assert steer.status_code == 200, steer.text
        assert steer.headers["X-Flywheel-Model-Version"] == baseline  # evil's routing, not acme's pin
        assert steer.headers["X-Flywheel-Generation"] != generation
        assert marker not in steer.text
        # The generation header is no way to name a feedback target; the session header names evil's own.
        err = _error(evil.post(FEEDBACK, json=_thumbs("steer-1"), headers={"X-Flywheel-Generation": generation}), 400)
        assert err["code"] == "missing_required_parameter"
        r = evil.post(FEEDBACK, json=_thumbs("steer-2"), headers={"X-Flywheel-Session": acme_session})
        assert r.status_code == 202, r.text
        # acme's session kept its version.
        assert _chat(acme, acme_session).headers["X-Flywheel-Model-Version"] == "3"
    asked = [v for s, v in stack.upstream.seen if s == acme_session]
    assert len(asked) == 3 and asked[0] == asked[2] == "3" and asked[1] in (None, baseline), asked

    seen = stack.drain()
    generations = [GenerationEvent.from_bytes(v) for v in seen[stack.settings.topic("generations")]]
    ours = sorted((g.tenant, g.model_version) for g in generations if g.session_id == acme_session)
    assert ours == [("acme", 3), ("acme", 3), ("evil", int(baseline))]
    feedback = [FeedbackEvent.from_bytes(v) for v in seen[stack.settings.topic("feedback")]]
    assert [(f.tenant, f.session_id) for f in feedback if f.feedback_id.startswith("steer-")] == [
        ("evil", acme_session)]
    assert not [t for t in (DB_SECRET, REDIS_SECRET, *stack.keys.values()) if t in _log_text(caplog)]


@dataclass
class _Engine:
    """What the node's admin route reads of its engine: the version it serves."""

    version: int = 1

    def current(self) -> tuple[int, str]:
        return self.version, "0" * 64

    def versions(self) -> list[int]:
        return [self.version]


@dataclass
class _Updater:
    """The node's updater as its admin route drives it; keeps every call it got."""

    calls: list[int | None] = field(default_factory=list)
    status: str = "serving"
    detail: str = ""

    def check_once(self) -> Any:
        from serving.node.updater import UpdateOutcome

        self.calls.append(None)
        return UpdateOutcome(True, False, 1)

    def update_to(self, version: int) -> Any:
        from serving.node.updater import UpdateOutcome

        self.calls.append(version)
        return UpdateOutcome(True, True, version)


def _outbound_ip() -> str | None:
    """This host's address on its default route (not loopback), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # a UDP connect sends nothing
            ip = probe.getsockname()[0]
        except OSError:
            return None
    return None if ipaddress.ip_address(ip).is_loopback else ip


def _served(app: Any, host: str) -> contextlib.AbstractContextManager[str]:
    return served_app(app, "/v1/models", host, header_timeout_s=HEADER_TIMEOUT_S)


@dataclass
class Node:
    loopback: str  # the node's app on 127.0.0.1
    external: str | None  # the same app on this host's outbound address, if it has one
    updater: _Updater


@pytest.fixture(scope="module")
def node(stack: Stack) -> Iterator[Node]:
    """The built-in node's HTTP app (its engine and updater are stand-ins: the routes under attack
    never reach them, and the admin route's calls are counted)."""
    from serving.node.app import create_app

    updater = _Updater()
    app = create_app(_Engine(), updater, stack.settings)  # type: ignore[arg-type]
    ip = _outbound_ip()
    with _served(app, "127.0.0.1") as loopback, \
            (_served(app, ip) if ip else contextlib.nullcontext(None)) as external:
        yield Node(loopback, external, updater)


def test_admin_routes_without_a_credential_answer_only_their_own_host(stack: Stack, node: Node,
                                                                     tmp_path: Path) -> None:
    """The node's ``/admin/update_weights`` and, with ``gateway.auth = "off"``, the gateway's admin
    routes take the TCP peer's address as their credential: no header makes a remote caller local."""
    from serving.gateway.app import create_app

    if node.external is None:
        pytest.skip("this host has no non-loopback address to call the node from")
    spoofs = [{}, {"X-Forwarded-For": "127.0.0.1"}, {"X-Real-IP": "127.0.0.1"}, {"Forwarded": "for=127.0.0.1"},
              {"Host": "localhost"}, {"X-Forwarded-For": "127.0.0.1", "X-Forwarded-Proto": "http", "Host": "127.0.0.1"}]
    for headers in spoofs:
        for body in (None, {"version": 0}):
            r = httpx.post(f"{node.external}/admin/update_weights", json=body, headers=headers, timeout=10)
            assert _error(r, 403)["code"] == "forbidden", headers
    assert node.updater.calls == []
    data = json.loads(stack.config.read_text())
    def open_gateway(name: str) -> Any:  # one spool each
        return create_app(load_settings(None, **{**data, "data_dir": str(tmp_path / name),
                                                 "gateway": {**data["gateway"], "auth": "off"}}))

    ip = urlsplit(node.external).hostname or ""
    with _served(open_gateway("remote"), ip) as remote, _served(open_gateway("local"), "127.0.0.1") as local:
        for headers in spoofs:
            for method, path, body in (("GET", "/admin/pins", None), ("PUT", "/admin/pins/acme", {"version": 4}),
                                       ("GET", "/admin/versions", None), ("GET", "/admin/capture", None),
                                       ("POST", "/admin/versions/4/promote", None), ("POST", "/admin/unpin", None)):
                r = httpx.request(method, f"{remote}{path}", json=body, headers=headers, timeout=10)
                assert _error(r, 403)["code"] == "admin_required", (path, headers)
        assert httpx.get(f"{local}/admin/pins", timeout=10).status_code == 200  # control
    with stack.client("admin") as admin:
        assert admin.get("/admin/pins").json()["pins"].get("acme") != 4  # the refused PUT changed nothing
    # The same app answers its own host (control: the peer address is what refused the others).
    assert httpx.post(f"{node.loopback}/admin/update_weights", json={"version": 2}, timeout=10).status_code == 200
    assert node.updater.calls == [2]
    node.updater.calls.clear()

    # The gateway forwards completions only: no path reaches a node's admin route through it.
    received = stack.upstream.received
    with stack.client("admin") as admin:
        assert admin.post("/admin/update_weights", json={}).status_code == 404
    for path in (b"/v1/../admin/update_weights", b"/v1/chat/completions/../../admin/update_weights",
                 b"/v1/%2e%2e/admin/update_weights", b"//admin/update_weights"):
        answer = raw_exchange(stack.address, b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                      + stack.keys["admin"].encode() + b"\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
        assert answer.split(b"\r\n", 1)[0] in (b"HTTP/1.1 404 Not Found", b"HTTP/1.1 400 Bad Request"), answer[:200]
    assert stack.upstream.received == received


# Path traversal in weight-store keys -----------------------------------------------------------

#: store_key values a forged registry row (or a tampered database) could name.
FORGED_KEYS = [
    "../outside/secret", "line/../../outside/secret", "..%2f..%2foutside%2fsecret", "%2e%2e/outside/secret",
    "line\\..\\..\\outside\\secret", "~/outside/secret", "C:\\outside\\secret", "line/./../outside/secret",
    "line//secret", ".hidden", "line/link/secret", "line/evil.full", "line/dangling.full",
]


@pytest.fixture
def traversal(tmp_path: Path, stack: Stack) -> Iterator[tuple[Path, Path, Any]]:
    """A folder store whose root holds symlinks out of it, the folder they point into, and the
    rows of a model line whose store keys are :data:`FORGED_KEYS` (status retired: gc's to delete)."""
    root, outside = tmp_path / "store", tmp_path / "outside"
    (root / "line").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret").write_bytes(b"the weights of another deployment")
    os.symlink(outside, root / "line" / "link")
    os.symlink(outside / "secret", root / "line" / "evil.full")
    os.symlink(outside / "new", root / "line" / "dangling.full")
    line = f"attack-{uuid.uuid4().hex[:8]}"
    absolute = str(outside / "secret")
    with stack.sessions() as db:
        db.add_all(ModelVersion(model_line=line, version=v, kind="full", parent=None, sha256="0" * 64, store_key=key,
                                bytes=1, full_bytes=1, status="retired", created_at=datetime.now(UTC))
                   for v, key in enumerate([*FORGED_KEYS, absolute]))
        db.commit()
    yield root, outside, line
    with stack.sessions() as db:
        db.execute(ModelVersion.__table__.delete().where(ModelVersion.model_line == line))
        db.execute(VersionTransition.__table__.delete().where(VersionTransition.model_line == line))
        db.commit()


def _tree(path: Path) -> dict[str, bytes | str]:
    return {str(p.relative_to(path)): (os.readlink(p) if p.is_symlink() else p.read_bytes() if p.is_file() else "dir")
            for p in sorted(path.rglob("*"))}


def test_forged_store_keys_never_read_write_or_delete_outside_the_store(stack: Stack, traversal, tmp_path) -> None:
    from flywheel.weights.collect import collect
    from flywheel.weights.registry import Registry, WeightsError
    from flywheel.weights.store import FolderStore, InvalidKey, RegionalCache
    from launch.cli import main

    root, outside, line = traversal
    before_outside, before_root = _tree(outside), _tree(root)
    cache_root = tmp_path / "cache"
    store = FolderStore(root)
    registry = Registry(stack.sessions, RegionalCache(store, FolderStore(cache_root)), line)  # a node's read path
    for info in registry.versions():
        with pytest.raises(WeightsError, match="unavailable"):  # what a node's updater gets: it keeps serving
            registry.load(info.version)
        for attempt in (lambda: store.put(info.store_key, b"x"), lambda: store.delete(info.store_key),
                        lambda: store.get(info.store_key), lambda: store.exists(info.store_key)):
            with pytest.raises(InvalidKey):
                attempt()
    # `flywheel weights gc` on the line: each forged row it reaches stops it with the reason; it never
    # deletes through one, however often it is run.
    config = tmp_path / "gc.json"
    config.write_text(json.dumps({**json.loads(stack.config.read_text()), "model": {"line": line, "path": ""},
                                  "store": {"kind": "folder", "path": str(root)}}))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert main(["--config", str(config), "weights", "gc"]) == 1
    assert "gc stopped" in err.getvalue() and "invalid object key" in err.getvalue()
    for _ in range(len(FORGED_KEYS) + 1):  # however often it is run
        with contextlib.suppress(InvalidKey):
            collect(registry)
    assert {i.status for i in registry.versions()} == {"collected"}
    assert _tree(outside) == before_outside and _tree(root) == before_root
    assert not [p for p in cache_root.rglob("*") if p.is_file() and ".locks" not in p.parts]
    assert not (tmp_path / "outside" / "new").exists()


def test_a_forged_store_key_cannot_reach_another_prefix_in_s3(stack: Stack, s3, s3_endpoint: str) -> None:  # noqa: F811
    from flywheel.weights.collect import collect
    from flywheel.weights.registry import Registry, WeightsError
    from flywheel.weights.store import S3Store

    S3Store(BUCKET, "team-b/", endpoint_url=s3_endpoint).put("line/v1.full", b"team b's weights")
    line = f"attack-{uuid.uuid4().hex[:8]}"
    keys = ["../team-b/line/v1.full", "line/../../team-b/line/v1.full", "/team-b/line/v1.full",
            "%2e%2e/team-b/line/v1.full", "..\\team-b\\line\\v1.full"]
    with stack.sessions() as db:
        db.add_all(ModelVersion(model_line=line, version=v, kind="full", parent=None, sha256="0" * 64, store_key=key,
                                bytes=1, full_bytes=1, status="retired", created_at=datetime.now(UTC))
                   for v, key in enumerate(keys))
        db.commit()
    registry = Registry(stack.sessions, S3Store(BUCKET, "team-a/", endpoint_url=s3_endpoint), line)
    for v in range(len(keys)):
        with pytest.raises(WeightsError, match="invalid object key"):
            registry.load(v)
    for _ in keys:
        with contextlib.suppress(Exception):
            collect(registry)
    assert [o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET)["Contents"]] == ["team-b/line/v1.full"]


def test_weights_cli_output_is_not_written_through_a_planted_symlink(tmp_path: Path) -> None:
    import safetensors.torch
    import torch

    from launch.cli import main

    shared = tmp_path / "shared"  # a folder others can write to, such as /tmp
    shared.mkdir()
    old, new = tmp_path / "old.safetensors", tmp_path / "new.safetensors"
    old.write_bytes(safetensors.torch.save({"w": torch.zeros(8, dtype=torch.bfloat16)}))
    new.write_bytes(safetensors.torch.save({"w": torch.ones(8, dtype=torch.bfloat16)}))
    victim = tmp_path / "victim"
    victim.write_bytes(b"someone else's file")
    out = shared / "delta.bin"
    for planted in (shared / ".delta.bin.tmp", shared / f".{out.name}.tmp"):  # the names a writer could predict
        if not planted.exists():
            os.symlink(victim, planted)
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["weights", "diff", str(old), str(new), "-o", str(out)]) == 0
    assert victim.read_bytes() == b"someone else's file"
    assert out.is_file() and not out.is_symlink() and out.stat().st_size > 0


# SQL injection ---------------------------------------------------------------------------------


def _header_value(payload: str) -> bytes:
    return payload.encode("utf-8")


def _as_received(payload: str) -> str:
    """A header value as the server reads it (bytes as latin-1)."""
    return payload.encode("utf-8").decode("latin-1")


def _nul_header(stack: Stack, path: bytes, name: bytes, value: bytes, key: str) -> bytes:
    """A request with a NUL in a header, sent raw (clients refuse to): the HTTP parser refuses it."""
    body = json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode()
    return raw_exchange(stack.address, b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + b"Authorization: Bearer " + key.encode() + b"\r\n" + name + b": " + value + b"\r\n"
                + b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)


def _sql_bearer(stack: Stack, payload: str) -> None:
    served = stack.upstream.received
    for token in (payload, f"fwk_{payload}", f"fwk_{stack.key_ids['acme']}_{payload}"):
        if "\x00" in token:
            assert _nul_header(stack, CHAT.encode(), b"Authorization", b"Bearer " + token.encode(), "x").startswith(
                b"HTTP/1.1 400")
            continue
        with httpx.Client(base_url=stack.url, timeout=20) as client:
            r = client.post(CHAT, json={"messages": [{"role": "user", "content": "x"}]},
                            headers={"Authorization": b"Bearer " + token.encode()})
        assert _error(r, 401)["code"] == "invalid_api_key"
    assert stack.upstream.received == served


def _sql_session_header(stack: Stack, payload: str) -> None:
    with stack.client("acme") as acme, stack.client("evil") as evil:
        if "\x00" in payload:
            assert _nul_header(stack, CHAT.encode(), b"X-Flywheel-Session", payload.encode(),
                               stack.keys["acme"]).startswith(b"HTTP/1.1 400")
            return
        r = _chat(acme, _header_value(payload))
        assert r.status_code == 200, r.text
        assert [v for k, v in r.headers.raw if k.lower() == b"x-flywheel-session"] == [_header_value(payload)]
        # On feedback: the owner's session is found by its literal id, nobody else's is.
        assert acme.post(FEEDBACK, json=_thumbs(f"sh-{uuid.uuid4().hex}"),
                         headers={"X-Flywheel-Session": _header_value(payload)}).status_code == 202
        theirs = evil.post(FEEDBACK, json=_thumbs(f"sh-{uuid.uuid4().hex}"),
                           headers={"X-Flywheel-Session": _header_value(payload)})
        assert _error(theirs, 404)["code"] == "session_not_found"


def _sql_feedback_session_id(stack: Stack, payload: str) -> None:
    with stack.client("acme") as acme, stack.client("evil") as evil:
        if "\x00" in payload:
            for client in (acme, evil):
                r = client.post(FEEDBACK, json=_thumbs("fs", session_id=payload))
                assert _error(r, 400)["param"] == "session_id"
            return
        err = _error(evil.post(FEEDBACK, json=_thumbs("fs", session_id=payload)), 404)
        assert err["code"] == "session_not_found"
        received = _as_received(payload)
        if _printable(received):
            assert _chat(acme, _header_value(payload)).status_code == 200
            assert acme.post(FEEDBACK, json=_thumbs(f"fs-{uuid.uuid4().hex}", session_id=received)).status_code == 202
            r = evil.post(FEEDBACK, json=_thumbs("fs", session_id=received))
            assert _error(r, 404)["code"] == "session_not_found"


def _sql_feedback_generation_id(stack: Stack, payload: str) -> None:
    with stack.client("acme") as acme, stack.client("evil") as evil:
        assert _chat(acme, f"fg-{uuid.uuid4().hex}").status_code == 200  # acme has generations to match
        for client in (acme, evil):
            r = client.post(FEEDBACK, json=_thumbs("fg", generation_id=payload))
            if "\x00" in payload:
                assert _error(r, 400)["param"] == "generation_id"
            else:
                assert _error(r, 404)["code"] == "generation_not_found"


def _sql_feedback_fields(stack: Stack, payload: str) -> None:
    session = f"ff-{uuid.uuid4().hex}"
    with stack.client("acme") as acme:
        assert _chat(acme, session).status_code == 200
        for item, refused in ((_thumbs(payload[:128], session_id=session), "feedback_id"),
                              ({**_thumbs(f"ff-{uuid.uuid4().hex}", session_id=session), "kind": "custom",
                                "signal": payload[:64]}, "signal"),
                              ({**_thumbs(f"ff-{uuid.uuid4().hex}", session_id=session), "comment": payload,
                                "data": {payload: payload}}, None)):
            r = acme.post(FEEDBACK, json=item)
            if "\x00" in payload and refused:
                assert _error(r, 400)["param"] == refused
            else:
                assert r.status_code == 202, r.text


def _sql_admin_pin_tenant(stack: Stack, payload: str) -> None:
    with stack.client("admin") as admin:
        before = admin.get("/admin/pins").json()
        r = admin.put(f"/admin/pins/{quote(payload, safe='')}", json={"version": 2})
        err = _error(r, 400, 404)
        assert r.status_code == 404 or err["param"] == "tenant"
        assert admin.get("/admin/pins").json() == before


def _sql_admin_pin_version(stack: Stack, payload: str) -> None:
    with stack.client("admin") as admin:
        before = admin.get("/admin/pins").json()
        assert _error(admin.put("/admin/pins/acme", json={"version": payload}), 400)["param"] == "version"
        assert admin.get("/admin/pins").json() == before


def _sql_admin_version_path(stack: Stack, payload: str) -> None:
    with stack.client("admin") as admin:
        quoted = quote(payload, safe="")
        for path in (f"/admin/versions/{quoted}/promote", f"/admin/versions/3/{quoted}"):
            _error(admin.post(path, json={"reason": "x"}), 400, 404)


_PROMOTED = iter(range(10**6))


def _sql_admin_reason(stack: Stack, payload: str) -> None:
    version = 1 + next(_PROMOTED) % 2  # alternately: each promote retires the other
    with stack.client("admin") as admin:
        r = admin.post(f"/admin/versions/{version}/promote", json={"reason": payload})
        if "\x00" in payload:
            assert _error(r, 400)["param"] == "reason"
            return
        if r.status_code == 409:  # already stable (an earlier test left it so): promote the other one
            version = 3 - version
            r = admin.post(f"/admin/versions/{version}/promote", json={"reason": payload})
        assert r.status_code == 200, r.text
    with stack.sessions() as db:
        reasons = db.scalars(select(VersionTransition.reason).where(VersionTransition.version == version)).all()
    assert any(reason.endswith(f": {payload}") for reason in reasons), reasons


HTTP_PARAMETERS: dict[str, Callable[[Stack, str], None]] = {
    "Authorization bearer key": _sql_bearer,
    "X-Flywheel-Session (completions, feedback)": _sql_session_header,
    "feedback session_id": _sql_feedback_session_id,
    "feedback generation_id": _sql_feedback_generation_id,
    "feedback feedback_id, signal, comment, data": _sql_feedback_fields,
    "PUT /admin/pins/{tenant}": _sql_admin_pin_tenant,
    "PUT /admin/pins version": _sql_admin_pin_version,
    "POST /admin/versions/{version}/{action}": _sql_admin_version_path,
    "POST /admin/versions reason": _sql_admin_reason,
}


@pytest.mark.parametrize("parameter", list(HTTP_PARAMETERS))
def test_sql_payloads_in_http_parameters_are_refused_or_literal(stack: Stack, parameter: str) -> None:
    for payload in PAYLOADS:
        HTTP_PARAMETERS[parameter](stack, payload)
    stack.assert_intact()


def _cli(stack: Stack, *argv: str) -> tuple[int, str, str]:
    from launch.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["--config", str(stack.config), *argv])
        except SystemExit as exc:  # argparse
            code = exc.code
    return int(code or 0), out.getvalue(), err.getvalue()


CLI_PAYLOADS = ["' OR '1'='1", "'; DROP TABLE api_keys; --", "\u01c5 \U0001f642 \u202e", "a\x00b"]


def _cli_keys_create_tenant(stack: Stack, payload: str) -> None:
    code, out, err = _cli(stack, "keys", "create", "--tenant", payload)
    assert code == 2 and "invalid tenant name" in err and out == ""


def _cli_keys_create_name(stack: Stack, payload: str) -> None:
    code, out, err = _cli(stack, "keys", "create", "--tenant", "acme", "--name", payload, "--json")
    if "\x00" in payload:
        assert code == 2 and "control characters" in err
        return
    assert code == 0, err
    created = json.loads(out)
    code, out, _ = _cli(stack, "keys", "list", "--tenant", "acme", "--json")
    names = {k["key_id"]: k["name"] for k in json.loads(out)}
    assert created["name"] == payload and names[created["key_id"]] == payload
    assert _cli(stack, "keys", "revoke", created["key_id"])[0] == 0


def _cli_keys_list_tenant(stack: Stack, payload: str) -> None:
    code, out, err = _cli(stack, "keys", "list", "--tenant", payload, "--json")
    assert code == 2 and "invalid tenant name" in err and out == ""


def _cli_keys_revoke(stack: Stack, payload: str) -> None:
    code, _, err = _cli(stack, "keys", "revoke", payload)
    assert code == 2 and "invalid key id" in err


def _cli_rollout_version(stack: Stack, payload: str) -> None:
    code, _, err = _cli(stack, "rollout", "promote", f"{payload}:3")
    assert code == 1 and "is not this deployment's" in err
    code, _, err = _cli(stack, "rollout", "promote", payload)
    assert code == 2 and "invalid version" in err


def _cli_rollout_reason(stack: Stack, payload: str) -> None:
    version = 5 + next(_PROMOTED) % 2
    code, _, err = _cli(stack, "rollout", "promote", str(version), "--reason", payload)
    if "\x00" in payload:
        assert code == 2 and "control characters" in err
        return
    if code == 1 and "already stable" in err:
        version = 11 - version
        code, _, err = _cli(stack, "rollout", "promote", str(version), "--reason", payload)
    assert code == 0, err
    with stack.sessions() as db:
        reasons = db.scalars(select(VersionTransition.reason).where(VersionTransition.version == version)).all()
    assert any(reason.endswith(f": {payload}") for reason in reasons), reasons


def _cli_rewards_spec_version(stack: Stack, payload: str) -> None:
    code, out, err = _cli(stack, "rewards", "report", "--spec-version", payload, "--json")
    if "\x00" in payload:
        assert code == 2 and "control characters" in err
    else:
        assert code == 0 and json.loads(out) == [], err


CLI_PARAMETERS: dict[str, Callable[[Stack, str], None]] = {
    "keys create --tenant": _cli_keys_create_tenant,
    "keys create --name": _cli_keys_create_name,
    "keys list --tenant": _cli_keys_list_tenant,
    "keys revoke KEY_ID": _cli_keys_revoke,
    "rollout promote LINE:V": _cli_rollout_version,
    "rollout promote --reason": _cli_rollout_reason,
    "rewards report --spec-version": _cli_rewards_spec_version,
}


@pytest.mark.parametrize("parameter", list(CLI_PARAMETERS))
def test_sql_payloads_in_cli_arguments_are_refused_or_literal(stack: Stack, parameter: str) -> None:
    for payload in CLI_PAYLOADS:
        CLI_PARAMETERS[parameter](stack, payload)
    stack.assert_intact()


def test_consumers_store_payload_ids_as_literal_values(stack: Stack) -> None:
    from ingest.worker import run as ingest_run
    from rewards.worker import run as rewards_run

    suffix = uuid.uuid4().hex[:6]
    sessions = {_as_received(p) + suffix: p for p in PAYLOADS if "\x00" not in p}
    feedback_ids = {}
    with stack.client("acme") as acme:
        for session, payload in sessions.items():
            assert _chat(acme, _header_value(payload) + suffix.encode()).status_code == 200
            feedback_id = f"{payload[:100]}{suffix}"
            r = acme.post(FEEDBACK, json={**_thumbs(feedback_id, session_id=session), "kind": "custom",
                                          "signal": payload[:40] + suffix,
                                          "comment": f"{payload}\x00{payload}", "data": {payload: "\x00"}})
            assert r.status_code == 202, r.text
            feedback_ids[feedback_id] = session
    stop = threading.Event()
    workers = [RoleThread("ingest", ingest_run, stack.settings, stop),
               RoleThread("rewards", rewards_run, stack.settings, stop)]
    for worker in workers:
        worker.start()
    try:
        def scored() -> bool:
            assert not [w.error for w in workers if w.error], [w.error for w in workers]
            with stack.sessions() as db:
                done = db.scalars(select(Trajectory.session_id).where(Trajectory.session_id.in_(sessions))).all()
                rows = db.execute(text("SELECT count(*) FROM scored_trajectories s JOIN trajectories t "
                                       "ON s.trajectory_id = t.trajectory_id WHERE t.session_id = ANY(:s)"),
                                  {"s": list(sessions)}).scalar()
            return set(done) == set(sessions) and rows >= len(sessions)

        wait_until("ingest and rewards to store the payload sessions", scored, timeout_s=45, every_s=0.3)
    finally:
        stop.set()
        for worker in workers:
            worker.join(30)
    assert not [w.error for w in workers if w.error]
    with stack.sessions() as db:
        generations = db.execute(select(Generation.tenant, Generation.session_id)
                                 .where(Generation.session_id.in_(sessions))).all()
        feedback = db.execute(select(Feedback.feedback_id, Feedback.session_id, Feedback.signal, Feedback.payload)
                              .where(Feedback.feedback_id.in_(feedback_ids))).all()
    assert sorted(generations) == sorted(("acme", s) for s in sessions)
    assert {f.feedback_id: f.session_id for f in feedback} == feedback_ids
    for row in feedback:
        payload = sessions[row.session_id]
        assert row.signal == payload[:40] + row.session_id[-6:]
        assert row.payload["comment"] == f"{payload}\x00{payload}" and row.payload["data"] == {payload: "\x00"}
    stack.assert_intact()


# Oversized and deeply nested payloads ----------------------------------------------------------


def _deep(n: int, kind: str) -> bytes:
    return b"[" * n + b"]" * n if kind == "array" else b'{"a":' * n + b"1" + b"}" * n


def _chunks(data: bytes, size: int = 65536) -> Iterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i:i + size]


@dataclass
class Route:
    method: str
    path: str
    who: str | None
    limit: int
    node: bool = False


ROUTES = [Route("POST", CHAT, "acme", 1_000_000), Route("POST", COMPLETIONS, "acme", 1_000_000),
          Route("POST", FEEDBACK, "acme", 1_000_000), Route("PUT", "/admin/pins/acme", "admin", 4096),
          Route("POST", "/admin/versions/3/promote", "admin", 4096), Route("POST", "/admin/unpin", "admin", 4096),
          Route("POST", CHAT, None, 1_000_000, node=True), Route("POST", COMPLETIONS, None, 1_000_000, node=True),
          Route("POST", "/admin/update_weights", None, 4096, node=True)]


@pytest.mark.parametrize("route", ROUTES,
                         ids=[f"{'node' if r.node else 'gateway'} {r.method} {r.path}" for r in ROUTES])
def test_oversized_and_deeply_nested_bodies_are_refused_with_4xx(stack: Stack, node: Node, route: Route,
                                                                  caplog) -> None:
    big = b'{"prompt": "' + b"x" * (route.limit + 1) + b'"}'
    cases: list[tuple[str, dict[str, Any], set[int]]] = [
        ("over the limit, Content-Length", {"content": big}, {413}),
        ("over the limit, chunked", {"content": _chunks(big)}, {413}),
        ("10^5 nested arrays", {"content": _deep(100_000, "array")}, {400, 413}),
        ("10^5 nested objects, chunked", {"content": _chunks(_deep(100_000, "object"))}, {400, 413}),
        ("100 nested arrays", {"content": _deep(100, "array")}, {400}),
        ("a 5000-digit integer", {"content": b'{"max_tokens": ' + b"9" * 5000 + b"}"},
         {400} if route.limit > 5100 else {413}),
        ("not UTF-8", {"content": b'{"prompt": "\xff\xfe"}'}, {400}),
        ("a lone surrogate", {"content": b'{"messages": [{"role": "user", "content": "\\ud800"}], "prompt": "\\ud800",'
                                         b' "feedback_id": "\\ud800", "kind": "explicit", "signal": "thumbs"}'}, {400}),
        ("a lone surrogate, UTF-16", {"content": '{"messages": [{"role": "user", "content": "\\udc00"}], '
                                                 '"prompt": "\\udc00"}'.encode("utf-16-le")}, {400}),
    ]
    if not route.node:  # a valid body reaches the node's engine, a stand-in here
        many = json.dumps({"messages": [{"role": "user", "content": "x"}] * 20_000, "prompt": "x" * 10,
                           "feedback_id": "f", "kind": "explicit", "signal": "thumbs", "session_id": "s-none"})
        long = json.dumps({"messages": [{"role": "user", "content": "y" * 450_000}], "prompt": "y" * 450_000})
        cases += [("20000 messages", {"content": many.encode()}, {200, 202, 400, 404, 413}),
                  ("two 450 kB strings", {"content": long.encode()}, {200, 400, 404, 413})]
    base = node.loopback if route.node else stack.url
    headers = {"Content-Type": "application/json"}
    if route.who:
        headers["Authorization"] = f"Bearer {stack.keys[route.who]}"
    with httpx.Client(base_url=base, headers=headers, timeout=30) as client:
        for name, kwargs, expected in cases:
            kwargs = {**kwargs, "headers": {**headers, **kwargs.get("headers", {})}}
            try:
                r = client.request(route.method, route.path, **kwargs)
            except httpx.RemoteProtocolError:  # refused before the whole body was sent: fine, if no 5xx
                continue
            assert r.status_code in expected, (name, r.status_code, r.text[:300])
            if r.status_code >= 400:
                assert r.json()["error"]["type"] == "invalid_request_error", name
        assert client.get("/v1/models").status_code == 200  # still serving
    # A Content-Length beyond any limit (and beyond 64 bits), for a two-byte body.
    address = urlsplit(base).hostname or "", urlsplit(base).port or 0
    auth = f"Authorization: {headers['Authorization']}\r\n".encode() if route.who else b""
    answer = raw_exchange(address, f"{route.method} {route.path} HTTP/1.1\r\nHost: x\r\n".encode() + auth
                  + b"Content-Length: " + b"9" * 30 + b"\r\nConnection: close\r\n\r\n{}", timeout_s=5)
    assert answer.split(b" ", 2)[1] in (b"400", b"413"), answer[:300]
    text = _log_text(caplog)
    assert "RecursionError" not in text and "unhandled error" not in text and "Traceback" not in text


def test_too_many_and_too_large_headers_are_refused_without_buffering(stack: Stack) -> None:
    auth = b"Authorization: Bearer " + stack.keys["acme"].encode() + b"\r\n"
    body = json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode()

    def request(extra: bytes) -> bytes:
        return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + auth + extra
                + b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode()
                + b"\r\nConnection: close\r\n\r\n" + body)

    many = b"".join(b"X-Pad-%d: v\r\n" % i for i in range(2000))  # 30 kB: fine
    assert raw_exchange(stack.address, request(many)).startswith(b"HTTP/1.1 200")
    for extra in (b"".join(b"X-Pad-%d: v\r\n" % i for i in range(8000)), b"X-Big: " + b"a" * 100_000 + b"\r\n"):
        answer = raw_exchange(stack.address, request(extra))
        assert answer == b"" or answer.startswith(b"HTTP/1.1 431"), answer[:200]
    # A 64 MB header: the server stops reading and closes long before it is sent.
    sent = 0
    with socket.create_connection(stack.address, timeout=5) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Huge: ")
        with contextlib.suppress(OSError):
            for _ in range(1024):
                sock.sendall(b"a" * 65536)
                sent += 65536
    assert sent < 32 << 20, "the gateway kept reading a 64 MB header"
    with stack.client("acme") as acme:
        assert _chat(acme).status_code == 200


# Slowloris -------------------------------------------------------------------------------------


async def _slow(address: tuple[str, int], head: bytes, trickle: bytes, every_s: float, limit_s: float
                ) -> tuple[float | None, bytes]:
    """Send ``head``, then ``trickle`` one byte per ``every_s``; returns when the server closed the
    connection (seconds after opening it, or None if it was still open at ``limit_s``) and what it sent."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    reader, writer = await asyncio.open_connection(*address)
    received = b""
    try:
        writer.write(head)
        i = 0
        while loop.time() - start < limit_s:
            if trickle:
                with contextlib.suppress(ConnectionError):
                    writer.write(trickle[i % len(trickle):i % len(trickle) + 1])
                    i += 1
            try:
                data = await asyncio.wait_for(reader.read(65536), every_s)
            except TimeoutError:
                continue
            except ConnectionError:
                return loop.time() - start, received
            if not data:
                return loop.time() - start, received
            received += data
        return None, received
    finally:
        writer.close()


def test_slow_clients_are_cut_off_while_others_are_served(stack: Stack, node: Node) -> None:
    acme, admin = stack.keys["acme"].encode(), stack.keys["admin"].encode()
    node_address = urlsplit(node.loopback).hostname or "", urlsplit(node.loopback).port or 0

    def head(method: bytes, path: bytes, key: bytes | None, length: int) -> bytes:
        auth = b"Authorization: Bearer " + key + b"\r\n" if key else b""
        return (method + b" " + path + b" HTTP/1.1\r\nHost: x\r\n" + auth
                + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % length)

    body = b'{"messages": [{"role": "user", "content": "' + b"z" * 10_000
    kinds: dict[str, tuple[tuple[str, int], bytes, bytes, bytes | None]] = {
        # name: (address, first bytes, trickled bytes, how the answer starts: None = closed silently)
        "silent connection": (stack.address, b"", b"", None),
        "headers, a byte at a time": (stack.address, b"", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Pad: "
                                      + b"a" * 1000, b"HTTP/1.1 408"),
        "chat body, a byte at a time": (stack.address, head(b"POST", b"/v1/chat/completions", acme, 20_000), body,
                                        b"HTTP/1.1 408"),
        "feedback body, a byte at a time": (stack.address, head(b"POST", b"/v1/feedback", acme, 20_000), body,
                                            b"HTTP/1.1 408"),
        "admin body, a byte at a time": (stack.address, head(b"PUT", b"/admin/pins/acme", admin, 4000), body,
                                         b"HTTP/1.1 408"),
        "a body nobody reads": (stack.address, head(b"GET", b"/health", None, 20_000), body, b"HTTP/1.1 200"),
        "node chat body, a byte at a time": (node_address, head(b"POST", b"/v1/chat/completions", None, 20_000), body,
                                             b"HTTP/1.1 408"),
        "node headers, a byte at a time": (node_address, b"", b"GET /v1/models HTTP/1.1\r\nX-Pad: " + b"a" * 1000,
                                           b"HTTP/1.1 408"),
    }
    per_kind, limit_s = 5, 6.0

    async def normal_client() -> list[float]:
        latencies = []
        async with httpx.AsyncClient(base_url=stack.url, headers={"Authorization": f"Bearer {stack.keys['acme']}"},
                                     timeout=10) as client:
            await asyncio.sleep(0.3)  # the slow ones are connected
            for _ in range(8):
                started = time.perf_counter()
                r = await client.post(CHAT, json={"messages": [{"role": "user", "content": "x"}]})
                assert r.status_code == 200, r.text
                latencies.append(time.perf_counter() - started)
                await asyncio.sleep(0.1)
        return latencies

    async def attack() -> tuple[list[tuple[str, float | None, bytes]], list[float]]:
        slow = [(name, _slow(address, first, trickle, 0.2, limit_s))
                for name, (address, first, trickle, _) in kinds.items() for _ in range(per_kind)]
        results = await asyncio.gather(normal_client(), *(coro for _, coro in slow))
        return [(name, *result) for (name, _), result in zip(slow, results[1:])], results[0]

    results, latencies = asyncio.run(attack())
    assert max(latencies) < 2.0, latencies
    bound = max(HEADER_TIMEOUT_S, BODY_TIMEOUT_S) + 2.5
    for name, closed_after, received in results:
        assert closed_after is not None and closed_after < bound, (name, closed_after, received[:200])
        expected = kinds[name][3]
        if expected is None:
            assert received == b"", name
        else:
            assert received.startswith(expected), (name, received[:200])
            if expected == b"HTTP/1.1 408":
                assert b'"code": "request_timeout"' in received or b'"code":"request_timeout"' in received, name


# Secrets ---------------------------------------------------------------------------------------


def test_secrets_never_reach_logs_error_messages_or_outputs(stack: Stack, caplog, monkeypatch, tmp_path) -> None:
    from serving.gateway.main import run as gateway_run

    caplog.set_level(logging.INFO)
    secret = f"s3cret-{uuid.uuid4().hex}"
    secrets = [secret, DB_SECRET, REDIS_SECRET, *stack.keys.values()]

    def clean(text: str) -> bool:
        return not [s for s in secrets if s in text]

    # 1. Everything the running gateway answers, errors included (its URLs carry passwords).
    texts = []
    with stack.client("admin") as admin, stack.client("acme") as acme, httpx.Client(base_url=stack.url) as nobody:
        for client, method, path in ((nobody, "GET", "/health"), (nobody, "GET", "/metrics"),
                                     (acme, "GET", "/v1/models"), (admin, "GET", "/admin/versions"),
                                     (admin, "GET", "/admin/capture"), (admin, "GET", "/admin/pins"),
                                     (nobody, "POST", CHAT), (acme, "GET", "/admin/pins"), (acme, "POST", FEEDBACK),
                                     (admin, "POST", "/admin/versions/99/promote")):
            texts.append(client.request(method, path, json={"bad": True}).text)
    assert all(clean(t) for t in texts)

    # 2. A gateway that cannot reach its database, whose URL carries the password twice over.
    bad_url = f"postgresql+psycopg2://flywheel:{secret}@127.0.0.1:1/x?password={secret}&sslpassword={secret}"
    bad = load_settings(None, **{**json.loads(stack.config.read_text()), "db": {"url": bad_url, "wait_s": 0.3},
                                 "data_dir": str(tmp_path / "bad"),
                                 "gateway": {**json.loads(stack.config.read_text())["gateway"], "port": free_port()}})
    switch, thresholds = sys.getswitchinterval(), gc.get_threshold()
    thread = RoleThread("gateway", gateway_run, bad, threading.Event())
    thread.start()
    thread.join(30)
    sys.setswitchinterval(switch)
    gc.set_threshold(*thresholds)
    assert not thread.is_alive() and thread.error is not None
    logs = _log_text(caplog)
    assert "not reachable" in logs and "flywheel:***@127.0.0.1:1" in logs, logs[-2000:]
    assert clean(logs) and clean(str(thread.error))

    # 3. The command line: settings, database errors, a URL whose password holds a raw '@'.
    monkeypatch.setenv("FLYWHEEL_DB__URL", bad_url)
    monkeypatch.setenv("FLYWHEEL_DB__WAIT_S", "0.3")
    monkeypatch.setenv("FLYWHEEL_LIVE__REDIS_URL", f"redis://:{secret}@127.0.0.1:6379/0")
    monkeypatch.setenv("FLYWHEEL_REWARDS__JUDGE_API_KEY", secret)
    from launch.cli import main

    outputs = []
    for argv in (["settings"], ["keys", "list"], ["db", "upgrade"], ["rollout", "status"]):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
        outputs.append((argv, code, out.getvalue() + err.getvalue()))
    assert [(a, c) for a, c, _ in outputs] == [(["settings"], 0), (["keys", "list"], 1), (["db", "upgrade"], 1),
                                               (["rollout", "status"], 1)]
    assert all(clean(t) and "***" in t for _, _, t in outputs), outputs
    settings_out = json.loads(outputs[0][2])
    assert settings_out["rewards"]["judge_api_key"] == "***" and settings_out["live"]["redis_url"] == \
        "redis://:***@127.0.0.1:6379/0"
    monkeypatch.setenv("FLYWHEEL_DB__URL", f"postgresql+psycopg2://flywheel:p@{secret}@127.0.0.1:1/x")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["keys", "list"]) == 2
    assert "percent-encode" in err.getvalue() and clean(err.getvalue())
    # The console script itself, as an operator runs it.
    env = {**os.environ, "FLYWHEEL_DB__URL": bad_url, "FLYWHEEL_DB__WAIT_S": "0.3"}
    run = subprocess.run([str(Path(sys.executable).with_name("flywheel")), "keys", "list"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "not reachable" in run.stderr and clean(run.stdout + run.stderr), run.stderr
    # The database-backed commands above logged nothing secret either.
    assert clean(_log_text(caplog))


def test_s3_credentials_never_reach_error_messages(s3_endpoint: str, monkeypatch, caplog) -> None:  # noqa: F811
    from flywheel.weights.store import S3Store, StoreError

    caplog.set_level(logging.DEBUG, logger="flywheel")
    secret = f"s3secret{uuid.uuid4().hex}"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDTEST")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    store = S3Store("no-such-bucket", "p/", endpoint_url=s3_endpoint)
    messages = []
    for attempt in (lambda: store.put("k", b"v"), lambda: store.get("k"), lambda: store.list()):
        with pytest.raises(StoreError) as failure:
            attempt()
        messages.append(f"{failure.value!r} {failure.value} {failure.value.__cause__}")
    assert all("no-such-bucket" in m and secret not in m for m in messages), messages
    assert secret not in repr(store) and secret not in _log_text(caplog)
