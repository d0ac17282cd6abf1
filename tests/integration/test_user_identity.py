"""End users' ids against a running gateway and ingest worker (real HTTP, uvicorn in a thread, a
stand-in upstream, the local bus, SQLite or PostgreSQL): a client names its user ``alice@example.com``
in the body, the header or both, whole and streamed, chat and text; afterwards the raw id is
looked for in every byte flywheel wrote (spool, bus log, database files, every stored row) and
everything the upstream and the logs received. Only its keyed hash may be there: the same on every
request and after a restart, another one under another deployment's secret."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import threading
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from bench.upstream import CannedUpstream
from flywheel import identity
from flywheel.db.models import Feedback, Generation
from flywheel.db.session import make_engine, make_session_factory
from flywheel.events import GenerationEvent
from flywheel.settings import Settings, load_settings
from ingest.worker import run as run_ingest
from serving.gateway.app import create_app
from tests.fixtures.roles import RoleThread, drain_capture, served_app, wait_until
from tests.integration.test_tenancy_attacks import running

pytestmark = pytest.mark.integration

RAW = "alice@example.com"
OTHER = "bob@example.com"
CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
MESSAGES = [{"role": "user", "content": "sort 3 1 2"}]


class RecordingUpstream(CannedUpstream):
    """The canned upstream, keeping every request body it received."""

    def __init__(self) -> None:
        super().__init__()
        self.bodies: list[bytes] = []

    async def respond(self, method: str, path: str, body: bytes, writer: asyncio.StreamWriter) -> None:
        if method == "POST":
            self.bodies.append(body)
        await super().respond(method, path, body, writer)


def _settings(data: Path, db_url: str, upstream_url: str, **gateway: Any) -> Settings:
    return load_settings(data_dir=str(data), bus={"kind": "local", "partitions": 2, "topic_prefix": "u."},
                         db={"url": db_url}, live={"kind": "memory"},
                         gateway={"upstream": upstream_url, "capture_ack": "fsynced", **gateway})


def _files(*roots: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for root in roots if root.exists() for p in sorted(root.rglob("*")) if p.is_file()}


def _stream(client: httpx.Client, path: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    with client.stream("POST", path, json={**body, "stream": True}, headers=headers) as r:
        r.read()
    return r


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url")


def test_the_raw_user_id_is_stored_nowhere_and_its_hash_is_stable(tmp_path, db_url, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    data = tmp_path / "data"
    with running(RecordingUpstream()) as (upstream, upstream_url):
        settings = _settings(data, db_url, upstream_url)
        stop = threading.Event()
        ingest = RoleThread("ingest", run_ingest, settings, stop)
        sessions = {name: f"{name}-{uuid.uuid4().hex[:8]}" for name in ("body", "header", "both", "text", "none")}
        with served_app(create_app(settings)) as url, httpx.Client(base_url=url, timeout=30) as client:
            ingest.start()
            answers = {
                "body": client.post(CHAT, json={"messages": MESSAGES, "user": RAW},
                                    headers={"X-Flywheel-Session": sessions["body"]}),
                "header": _stream(client, CHAT, {"messages": MESSAGES},
                                  **{"X-Flywheel-Session": sessions["header"], "X-Flywheel-User": RAW}),
                "both": client.post(CHAT, json={"messages": MESSAGES, "user": RAW, "n": 2},
                                    headers={"X-Flywheel-Session": sessions["both"], "X-Flywheel-User": RAW}),
                "text": _stream(client, TEXT, {"prompt": "sort 3 1 2", "user": RAW},
                                **{"X-Flywheel-Session": sessions["text"]}),
                "none": client.post(CHAT, json={"messages": MESSAGES, "user": ""},
                                    headers={"X-Flywheel-Session": sessions["none"]}),
            }
            for name, r in answers.items():
                assert r.status_code == 200, (name, r.text)
            asked = len(upstream.bodies)
            # Two users at once: refused by name before anything is routed, sent or recorded.
            conflict = client.post(CHAT, json={"messages": MESSAGES, "user": RAW},
                                   headers={"X-Flywheel-User": OTHER, "X-Flywheel-Session": f"x-{uuid.uuid4().hex}"})
            assert conflict.status_code == 400, conflict.text
            error = conflict.json()["error"]
            assert (error["param"], error["code"]) == ("user", "user_conflict")
            assert RAW not in conflict.text and OTHER not in conflict.text
            # An id longer than the data routes take: refused, so every id taken can be erased by it.
            long = client.post(CHAT, json={"messages": MESSAGES, "user": "u" * 1025},
                               headers={"X-Flywheel-Session": f"x-{uuid.uuid4().hex}"})
            assert long.status_code == 400, long.text
            assert (long.json()["error"]["param"], long.json()["error"]["code"]) == ("user", "invalid_user")
            assert len(upstream.bodies) == asked
            generation = answers["body"].headers["X-Flywheel-Generation"]
            r = client.post("/v1/feedback", json={"feedback_id": f"fb-{uuid.uuid4().hex}", "generation_id": generation,
                                                  "kind": "explicit", "signal": "thumbs", "value": 1})
            assert r.status_code == 202, r.text
            with httpx.Client(base_url=url, timeout=30) as admin:
                records = drain_capture(admin, settings)
            engine = make_engine(settings.database_url)
            db = make_session_factory(engine)

            def stored() -> bool:
                assert ingest.error is None, ingest.error
                with db() as s:
                    rows = s.scalar(select(Generation.event_id).where(Generation.session_id.in_(sessions.values()))
                                    .order_by(Generation.event_id).limit(1).offset(5))
                    return rows is not None and s.scalar(select(Feedback.event_id).limit(1)) is not None

            try:
                wait_until("ingest to store every generation and the feedback", stored, timeout_s=60)
            finally:
                stop.set()
                ingest.join(30)
            assert ingest.error is None, ingest.error

    secret = (data / identity.SECRET_FILE).read_text().strip()
    expected = hmac.new(secret.encode(), f"local\x00{RAW}".encode(), hashlib.sha256).hexdigest()
    wanted = {name: (None if name == "none" else expected) for name in sessions}

    # The database: the column, and not a byte of the raw id in any stored row.
    with db() as s:
        rows = s.execute(select(Generation.session_id, Generation.user_hash, Generation.payload)
                         .where(Generation.session_id.in_(sessions.values()))).all()
        found = s.scalars(select(Generation.session_id).where(Generation.tenant == "local",
                                                              Generation.user_hash == expected)).all()
        feedback = s.scalars(select(Feedback.payload)).all()
    engine.dispose()
    by_session = {session: name for name, session in sessions.items()}
    assert len(rows) == 6  # n = 2 is two generations
    assert {(by_session[r.session_id], r.user_hash) for r in rows} == set(wanted.items())
    assert sorted(found) == sorted(sessions[n] for n in ("body", "header", "both", "both", "text"))
    for row in rows:
        assert RAW not in json.dumps(row.payload) and "user" not in row.payload["request"]
        assert row.payload["user_hash"] == wanted[by_session[row.session_id]]
    assert feedback and not [p for p in feedback if RAW in json.dumps(p)]

    # The bus: the same events, with the hash.
    events = [GenerationEvent.from_bytes(v) for v in records[settings.topic("generations")]]
    assert {(by_session[e.session_id], e.user_hash) for e in events} == set(wanted.items())
    assert not [v for values in records.values() for v in values if RAW.encode() in v]

    # Every file flywheel wrote (spool, bus log, SQLite and its journal), every upstream body, every log line.
    written = _files(data, tmp_path / "db")
    assert any("spool" in p.parts for p in written) and any("bus" in p.parts for p in written)
    assert not [p for p, content in written.items() if RAW.encode() in content or OTHER.encode() in content]
    assert not [b for b in upstream.bodies if RAW.encode() in b]
    sent = [json.loads(b).get("user") for b in upstream.bodies]
    assert sent.count(expected) == 4 and sent.count(None) == 1
    assert not [r.getMessage() for r in caplog.records if RAW in r.getMessage() or OTHER in r.getMessage()]

    # Stable across a restart (the secret file is read back); another deployment's secret, another hash.
    with running(RecordingUpstream()) as (upstream, upstream_url):
        for data_dir, setting, hashed in (
            (data, "", expected),
            (tmp_path / "other", "z" * 40, hmac.new(b"z" * 40, f"local\x00{RAW}".encode(), hashlib.sha256).hexdigest()),
        ):
            again = _settings(data_dir, db_url, upstream_url, user_id_secret=setting)
            with served_app(create_app(again)) as url, httpx.Client(base_url=url, timeout=30) as client:
                assert client.post(CHAT, json={"messages": MESSAGES, "user": RAW}).status_code == 200
            assert json.loads(upstream.bodies[-1])["user"] == hashed
    assert hashed != expected
    assert not (tmp_path / "other" / identity.SECRET_FILE).exists()  # the setting, no file
