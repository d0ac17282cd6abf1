"""Gateway input validation: bad requests get a 4xx OpenAI envelope and never touch the bus.

The gateway runs in-process (FastAPI TestClient) on a real local-log bus in ``tmp_path``. None of
these requests should reach an upstream; the upstream URL points at a closed port so a request
that did would fail loudly with a 502 rather than pass.
"""

from __future__ import annotations

import json
import socket
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from flywheel.bus import make_bus
from flywheel.events import FeedbackEvent, feedback_event_id
from flywheel.settings import load_settings
from serving.gateway.app import create_app

pytestmark = pytest.mark.unit


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def settings(tmp_path):
    return load_settings(
        data_dir=str(tmp_path),
        bus={"kind": "local", "partitions": 2, "topic_prefix": "t."},
        gateway={"max_body_bytes": 2048, "upstream": f"http://127.0.0.1:{_closed_port()}"},
    )


@pytest.fixture
def bus(settings):
    bus = make_bus(settings)
    bus.ensure_topics([settings.topic("generations"), settings.topic("feedback")])
    yield bus
    bus.close()


@pytest.fixture
def client(settings, bus):
    producer = bus.producer()
    app = create_app(settings, producer, httpx.AsyncClient())
    with TestClient(app) as c:
        yield c
    producer.close()


def _drain(bus, settings, group: str) -> dict[str, list[bytes]]:
    consumer = bus.consumer(group, [settings.topic("generations"), settings.topic("feedback")])
    seen: dict[str, list[bytes]] = {settings.topic("generations"): [], settings.topic("feedback"): []}
    try:
        for _ in range(3):  # a few empty polls: the log is local, so nothing is in flight
            for record in consumer.poll(timeout_s=0.2, max_records=1000):
                seen[record.topic].append(record.value)
    finally:
        consumer.close()
    return seen


def _envelope(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    return err


CHAT = "/v1/chat/completions"
GOOD_MESSAGES = [{"role": "user", "content": "sort 3 1 2"}]


def test_rejected_requests_get_envelopes_and_leave_the_bus_untouched(client, bus, settings):
    # One accepted feedback first: it must survive everything that follows, exactly once.
    accepted = client.post(
        "/v1/feedback",
        json={"feedback_id": "fb-1", "session_id": "s-1", "kind": "explicit", "signal": "thumbs", "value": 1},
    )
    assert accepted.status_code == 202, accepted.text
    expected_id = feedback_event_id(settings.gateway.default_tenant, "fb-1")
    assert accepted.json() == {"accepted": 1, "event_ids": [expected_id]}

    err = _envelope(client.post(CHAT, content=b'{"messages": [', headers={"content-type": "application/json"}), 400)
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_json"

    err = _envelope(client.post(CHAT, json=["not", "an", "object"]), 400)
    assert "JSON object" in err["message"]

    err = _envelope(client.post(CHAT, json={"model": "tiny-sim"}), 400)
    assert err["param"] == "messages" and err["code"] == "missing_required_parameter"

    err = _envelope(client.post(CHAT, json={"messages": []}), 400)
    assert err["param"] == "messages"

    err = _envelope(client.post(CHAT, json={"messages": "sort 3 1 2"}), 400)
    assert err["param"] == "messages"

    err = _envelope(client.post(CHAT, json={"messages": [{"role": "robot", "content": "hi"}]}), 400)
    assert err["param"] == "messages.0.role"
    assert "'user'" in err["message"]  # says which roles are valid

    err = _envelope(client.post(CHAT, json={"messages": GOOD_MESSAGES, "temperature": "hot"}), 400)
    assert err["param"] == "temperature"

    err = _envelope(client.post(CHAT, json={"messages": GOOD_MESSAGES, "temperature": 7.5}), 400)
    assert err["param"] == "temperature" and "2" in err["message"]

    err = _envelope(client.post(CHAT, json={"messages": GOOD_MESSAGES, "max_tokens": 0}), 400)
    assert err["param"] == "max_tokens"

    err = _envelope(client.post(CHAT, json={"messages": GOOD_MESSAGES, "logprobs": "yes"}), 400)
    assert err["param"] == "logprobs"

    err = _envelope(client.post(CHAT, json={"messages": GOOD_MESSAGES, "stream": "yes"}), 400)
    assert err["param"] == "stream"

    err = _envelope(client.post(CHAT, json={"messages": GOOD_MESSAGES, "stream_options": {"include_usage": True}}), 400)
    assert err["param"] == "stream_options"

    huge = json.dumps({"messages": [{"role": "user", "content": "x" * 5000}]}).encode()
    err = _envelope(client.post(CHAT, content=huge, headers={"content-type": "application/json"}), 413)
    assert err["code"] == "request_too_large" and "2048" in err["message"]

    # Feedback: unknown kind, a signal of the wrong kind, missing id, missing session, bad batch.
    fb = {"feedback_id": "fb-2", "session_id": "s-1", "kind": "explicit", "signal": "thumbs", "value": 1}
    err = _envelope(client.post("/v1/feedback", json=dict(fb, kind="vibes")), 400)
    assert err["param"] == "kind"
    for kind in ("explicit", "implicit", "outcome", "custom"):
        assert kind in err["message"]

    err = _envelope(client.post("/v1/feedback", json=dict(fb, kind="outcome", signal="thumbs")), 400)
    assert err["param"] == "signal" and "task_solved" in err["message"]

    err = _envelope(client.post("/v1/feedback", json={k: v for k, v in fb.items() if k != "feedback_id"}), 400)
    assert err["param"] == "feedback_id"

    err = _envelope(client.post("/v1/feedback", json={k: v for k, v in fb.items() if k != "session_id"}), 400)
    assert err["param"] == "session_id"

    err = _envelope(client.post("/v1/feedback", json=dict(fb, value="great")), 400)
    assert err["param"] == "value"

    err = _envelope(client.post("/v1/feedback", json=dict(fb, rating_scale=5)), 400)
    assert err["param"] == "rating_scale"  # unknown fields are typos, not silently dropped

    batch = [dict(fb, feedback_id=f"b-{i}") for i in range(3)]
    batch[2]["kind"] = "nope"
    err = _envelope(client.post("/v1/feedback", json={"feedback": batch}), 400)
    assert err["param"] == "feedback.2.kind"  # and the two valid items of the batch are not written

    batch[2]["kind"] = "implicit"  # implicit signals do not include "thumbs"
    err = _envelope(client.post("/v1/feedback", json={"feedback": batch}), 400)
    assert err["param"] == "feedback.2.signal"

    err = _envelope(client.get("/v1/nowhere"), 404)
    assert err["type"] == "not_found_error"

    seen = _drain(bus, settings, "check-1")
    assert seen[settings.topic("generations")] == []
    values = seen[settings.topic("feedback")]
    assert len(values) == 1
    event = FeedbackEvent.from_bytes(values[0])
    assert (event.event_id, event.feedback_id, event.session_id, event.signal) == (expected_id, "fb-1", "s-1", "thumbs")


def test_feedback_batches_and_retries_keep_their_ids(client, bus, settings):
    items = [
        {"feedback_id": "r-1", "kind": "outcome", "signal": "task_solved", "value": 1, "generation_id": "g-1"},
        {"feedback_id": "r-2", "kind": "custom", "signal": "latency_complaint", "data": {"ms": 900}},
    ]
    first = client.post("/v1/feedback", json={"feedback": items}, headers={"X-Flywheel-Session": "s-9"})
    retry = client.post("/v1/feedback", json={"feedback": items}, headers={"X-Flywheel-Session": "s-9"})
    assert first.status_code == retry.status_code == 202
    assert first.json() == retry.json()
    tenant = settings.gateway.default_tenant
    assert first.json()["event_ids"] == [feedback_event_id(tenant, "r-1"), feedback_event_id(tenant, "r-2")]

    events = [FeedbackEvent.from_bytes(v) for v in _drain(bus, settings, "check-2")[settings.topic("feedback")]]
    # At-least-once on the bus; the ids make the retry a duplicate that consumers drop.
    assert sorted(e.event_id for e in events) == sorted(first.json()["event_ids"] * 2)
    assert {e.session_id for e in events} == {"s-9"}
    assert {e.data["ms"] for e in events if e.kind == "custom"} == {900}

    metrics = client.get("/metrics").text
    assert "flywheel_feedback_captured_total 4.0" in metrics
    assert "flywheel_generations_captured_total 0.0" in metrics


def test_unreachable_upstream_is_a_502_and_nothing_is_captured(client, bus, settings):
    r = client.post(CHAT, json={"messages": GOOD_MESSAGES}, headers={"X-Flywheel-Session": "s-2"})
    err = _envelope(r, 502)
    assert err["type"] == "upstream_error" and err["code"] == "upstream_unreachable"
    assert _drain(bus, settings, "check-3")[settings.topic("generations")] == []
    assert client.get("/health").json()["status"] == "ok"


def test_a_bus_that_refuses_the_event_is_a_503_not_an_acknowledgement(settings, bus):
    producer = bus.producer()
    producer.close()  # a real producer that can no longer write
    app = create_app(settings, producer, httpx.AsyncClient())
    with TestClient(app) as client:
        r = client.post(
            "/v1/feedback",
            json={"feedback_id": "lost?", "session_id": "s-3", "kind": "explicit", "signal": "thumbs", "value": -1},
        )
        err = _envelope(r, 503)
        assert err["code"] == "capture_unavailable" and "retry" in err["message"]
        assert "flywheel_feedback_captured_total 0.0" in client.get("/metrics").text
    assert _drain(bus, settings, "check-4")[settings.topic("feedback")] == []


def test_hostile_bodies_get_a_400_never_a_500(tmp_path):
    """Nesting past the parser's recursion limit, nesting the event could not serialise, control
    characters in ids and session headers, non-finite values, out-of-range seeds."""
    from fastapi.testclient import TestClient

    from flywheel.bus import make_bus
    from flywheel.settings import load_settings
    from serving.gateway.app import create_app

    import httpx

    settings = load_settings(data_dir=str(tmp_path), gateway={"upstream": "http://127.0.0.1:9"})
    bus = make_bus(settings)
    with TestClient(create_app(settings, bus.producer(), httpx.AsyncClient())) as client:
        deep = "[" * 100_000 + "]" * 100_000
        assert client.post("/v1/chat/completions", content=deep).status_code == 400
        nested = {"model": "m", "messages": [{"role": "user", "content": "x"}], "metadata": {}}
        cursor = nested["metadata"]
        for _ in range(200):
            cursor["a"] = {}
            cursor = cursor["a"]
        r = client.post("/v1/chat/completions", json=nested)
        assert r.status_code == 400 and "nests deeper" in r.json()["error"]["message"]
        chat = {"messages": [{"role": "user", "content": "x"}]}
        assert client.post("/v1/chat/completions", json=chat | {"seed": 2**64}).status_code == 400
        r = client.post("/v1/chat/completions", json=chat, headers={"X-Flywheel-Session": "a\x01b"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "session_id"
        for bad in ({"feedback_id": "a\x00b"}, {"session_id": "s\x00"}, {"signal": "x\x00", "kind": "custom"}):
            item = {"feedback_id": "f", "session_id": "s", "kind": "explicit", "signal": "thumbs", "value": 1} | bad
            r = client.post("/v1/feedback", json=item)
            assert r.status_code == 400, (bad, r.text)
        r = client.post("/v1/feedback", content=b'{"feedback_id": "f", "session_id": "s", "kind": "outcome", '
                                                 b'"signal": "task_solved", "value": NaN}')
        assert r.status_code == 400
    bus.close()
