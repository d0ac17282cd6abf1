"""Session URLs (``/sessions/{id}/v1/...``) for agents that cannot set headers: the official
``openai`` SDK with ``base_url`` on a session URL against the node + gateway stack (real HTTP, the
module's ``served`` stack of conftest.py), recorded exactly as with ``X-Flywheel-Session``; a header
that disagrees is a 400; feedback through the URL; and tenancy unchanged with auth on (keys in
SQLite, the canned upstream of ``bench.upstream``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from bench.upstream import running
from flywheel.db.session import make_engine, make_session_factory, upgrade
from flywheel.events import FeedbackEvent, GenerationEvent
from flywheel.keys import create_key
from flywheel.settings import load_settings
from serving.gateway.app import create_app
from testbed.procs import free_port
from tests.fixtures.roles import MESSAGES, drain_capture
from tests.integration.test_streaming import Served

pytestmark = pytest.mark.integration


def sdk(served: Served, session: str, **headers: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.gateway}/sessions/{session}/v1", api_key="unused", max_retries=0,
                         timeout=60, default_headers=headers or None)


def feedback_events(served: Served, feedback_ids: set[str], timeout_s: float = 10.0) -> dict[str, FeedbackEvent]:
    """The recorded feedback events of these ids (a fresh consumer group reads the whole topic)."""
    consumer = served.bus.consumer(f"check-{uuid.uuid4().hex[:8]}", [served.settings.topic("feedback")])
    found: dict[str, FeedbackEvent] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and set(found) != feedback_ids:
            for record in consumer.poll(timeout_s=0.2, max_records=1000):
                event = FeedbackEvent.from_bytes(record.value)
                if event.feedback_id in feedback_ids:
                    found[event.feedback_id] = event
    finally:
        consumer.close()
    return found


def test_an_sdk_on_a_session_url_is_one_session_as_with_the_header(served):
    session = f"url-{uuid.uuid4().hex}"
    line = served.settings.model.line
    with sdk(served, session) as client:
        raw = client.chat.completions.with_raw_response.create(model=line, messages=MESSAGES, max_tokens=6, seed=3)
        assert raw.headers["X-Flywheel-Session"] == session
        generations = [raw.headers["X-Flywheel-Generation"]]
        with client.chat.completions.with_streaming_response.create(
                model=line, messages=MESSAGES, max_tokens=6, seed=3, stream=True) as streamed:
            assert streamed.headers["X-Flywheel-Session"] == session
            generations.append(streamed.headers["X-Flywheel-Generation"])
            assert list(streamed.parse())
        text = client.completions.with_raw_response.create(model=line, prompt="sort: 3 1 2", max_tokens=6)
        assert text.headers["X-Flywheel-Session"] == session
        generations.append(text.headers["X-Flywheel-Generation"])
        assert [m.id for m in client.models.list()] == [line]
    # The same session through the plain API and the header: one session, one sticky version.
    with openai.OpenAI(base_url=f"{served.gateway}/v1", api_key="unused", max_retries=0, timeout=60) as plain:
        by_header = plain.chat.completions.with_raw_response.create(
            model=line, messages=MESSAGES, max_tokens=6, seed=3, extra_headers={"X-Flywheel-Session": session})
    assert by_header.headers["X-Flywheel-Session"] == session
    assert by_header.headers["X-Flywheel-Model-Version"] == raw.headers["X-Flywheel-Model-Version"]
    generations.append(by_header.headers["X-Flywheel-Generation"])
    events = served.events(generations)
    assert all(len(events[g]) == 1 for g in generations), events
    recorded: list[GenerationEvent] = [events[g][0] for g in generations]
    assert {(e.tenant, e.session_id, e.model_version) for e in recorded} == {
        (served.settings.gateway.default_tenant, session, int(raw.headers["X-Flywheel-Model-Version"]))}
    # Same request, same seed, same session: the path and the header serve the same answer.
    assert recorded[0].completion_token_ids == recorded[-1].completion_token_ids


def test_a_session_header_that_disagrees_with_the_path_is_a_400(served):
    session = f"url-{uuid.uuid4().hex}"
    line = served.settings.model.line
    with sdk(served, session, **{"X-Flywheel-Session": "someone-else"}) as client:
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model=line, messages=MESSAGES, max_tokens=4)
        assert (bad.value.status_code, bad.value.code, bad.value.param) == (400, "session_mismatch", "session_id")
        with pytest.raises(openai.BadRequestError):
            client.models.list()
    with sdk(served, session, **{"X-Flywheel-Session": session}) as client:  # agreeing is fine
        assert client.chat.completions.create(model=line, messages=MESSAGES, max_tokens=4).choices
    with sdk(served, "bad%01id") as client, pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=line, messages=MESSAGES, max_tokens=4)
    assert bad.value.param == "session_id"


def test_feedback_through_the_session_url(served):
    session = f"url-{uuid.uuid4().hex}"
    with sdk(served, session) as client:
        raw = client.chat.completions.with_raw_response.create(model=served.settings.model.line, messages=MESSAGES,
                                                               max_tokens=4)
        generation = raw.headers["X-Flywheel-Generation"]
        # The SDK's own generic POST, relative to its base_url: an agent needs nothing but the URL.
        answer = client.post("/feedback", cast_to=httpx.Response, body={
            "feedback_id": f"{session}-1", "generation_id": generation, "metric": "thumbs", "value": 1})
        assert answer.status_code == 202 and answer.headers["X-Flywheel-Session"] == session
    answer = httpx.post(f"{served.gateway}/sessions/{session}/v1/feedback", json={"feedback": [
        {"feedback_id": f"{session}-2", "kind": "outcome", "signal": "task_solved", "value": 1},
        {"feedback_id": f"{session}-3", "metric": "abandon"}]})
    assert answer.status_code == 202, answer.text
    # Feedback on another session's generation through this session's URL is refused, as with the header.
    answer = httpx.post(f"{served.gateway}/sessions/other-{session}/v1/feedback", json={
        "feedback_id": f"{session}-4", "generation_id": generation, "metric": "thumbs", "value": -1})
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "session_mismatch"
    ids = {f"{session}-{i}" for i in (1, 2, 3)}
    events = feedback_events(served, ids)
    assert set(events) == ids
    assert {(e.feedback_id, e.session_id, e.kind, e.signal) for e in events.values()} == {
        (f"{session}-1", session, "explicit", "thumbs"), (f"{session}-2", session, "outcome", "task_solved"),
        (f"{session}-3", session, "implicit", "abandon")}
    assert events[f"{session}-1"].generation_id == generation


@pytest.fixture
def tenants(tmp_path) -> Iterator[tuple[TestClient, dict[str, str], Any]]:
    """A gateway with auth on (keys in SQLite) before the canned upstream; keys by tenant and ``admin``."""
    db_url = f"sqlite:///{tmp_path / 'db' / 'flywheel.db'}"
    upgrade(db_url)
    engine = make_engine(db_url)
    keys = {who: create_key(make_session_factory(engine), tenant, role=role, name=who)[1]
            for who, tenant, role in (("acme", "acme", "tenant"), ("evil", "evil", "tenant"), ("admin", "ops", "admin"))}
    port = free_port()
    with running(port):
        settings = load_settings(data_dir=str(tmp_path / "data"), db={"url": db_url},
                                 bus={"kind": "local", "partitions": 1, "topic_prefix": "su."},
                                 gateway={"auth": "on", "upstream": f"http://127.0.0.1:{port}"})
        with TestClient(create_app(settings)) as client:
            yield client, keys, settings
    engine.dispose()


def test_session_urls_keep_sessions_the_tenants(tenants):
    client, keys, settings = tenants

    def auth(who: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {keys[who]}"}

    chat = {"messages": MESSAGES}
    assert client.post("/sessions/shared/v1/chat/completions", json=chat).status_code == 401
    acme = client.post("/sessions/shared/v1/chat/completions", json=chat, headers=auth("acme"))
    assert acme.status_code == 200, acme.text
    generation = acme.headers["X-Flywheel-Generation"]
    # evil names acme's session: not found, exactly as with the header; its own "shared" is another session.
    for item in ({"feedback_id": "e-1", "metric": "task_solved", "value": 0},
                 {"feedback_id": "e-2", "metric": "thumbs", "value": -1, "generation_id": generation}):
        r = client.post("/sessions/shared/v1/feedback", json=item, headers=auth("evil"))
        assert r.status_code == 404, r.text
    evil = client.post("/sessions/shared/v1/chat/completions", json=chat, headers=auth("evil"))
    assert evil.status_code == 200
    r = client.post("/sessions/shared/v1/feedback", headers=auth("acme"),
                    json={"feedback_id": "a-1", "metric": "thumbs", "value": 1, "generation_id": generation})
    assert r.status_code == 202, r.text

    client.headers.update(auth("admin"))
    seen = drain_capture(client, settings)
    generated = [GenerationEvent.from_bytes(v) for v in seen[settings.topic("generations")]]
    assert sorted((e.tenant, e.session_id) for e in generated) == [("acme", "shared"), ("evil", "shared")]
    feedback = [FeedbackEvent.from_bytes(v) for v in seen[settings.topic("feedback")]]
    assert [(e.tenant, e.session_id, e.feedback_id) for e in feedback] == [("acme", "shared", "a-1")]
