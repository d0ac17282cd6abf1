"""Gateway input validation: bad requests get a 4xx OpenAI envelope and never touch the bus.

The gateway runs in-process (FastAPI TestClient, its whole lifespan: spool, shipper, SQLite, memory
state) on a real local-log bus in ``tmp_path``, in front of the canned vLLM-shaped upstream of
``bench.upstream``. Checks of what reached the bus wait until the spool has shipped everything.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from bench.upstream import running
from flywheel.bus import make_bus
from flywheel.events import FeedbackEvent, feedback_event_id
from flywheel.settings import load_settings
from serving.gateway.app import create_app
from tests.fixtures.roles import RefusingProducer, free_port, wait_until

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def upstream():
    port = free_port()
    with running(port) as canned:
        canned.url = f"http://127.0.0.1:{port}"
        yield canned


@pytest.fixture
def settings(tmp_path, upstream):
    return load_settings(
        data_dir=str(tmp_path),
        bus={"kind": "local", "partitions": 2, "topic_prefix": "t."},
        gateway={"max_body_bytes": 2048, "upstream": upstream.url},
    )


@pytest.fixture
def bus(settings):
    bus = make_bus(settings)
    bus.ensure_topics([settings.topic("generations"), settings.topic("feedback")])
    yield bus
    bus.close()


@pytest.fixture
def client(settings, bus):
    with TestClient(create_app(settings)) as c:
        yield c


def _drain(client: TestClient, bus, settings, group: str) -> dict[str, list[bytes]]:
    """Everything on the bus once the gateway's spool has shipped all it holds."""
    wait_until("the spool to ship", lambda: client.get("/admin/capture").json()["events"] == 0, timeout_s=20)
    consumer = bus.consumer(group, [settings.topic("generations"), settings.topic("feedback")])
    seen: dict[str, list[bytes]] = {settings.topic("generations"): [], settings.topic("feedback"): []}
    try:
        for _ in range(3):  # a few empty polls: the log is local, so nothing is in flight
            for record in consumer.poll(timeout_s=0.2, max_records=1000):
                seen[record.topic].append(record.value)
    finally:
        consumer.close()
    return seen


def _chat(client: TestClient, session: str) -> str:
    r = client.post("/v1/chat/completions", json={"messages": GOOD_MESSAGES}, headers={"X-Flywheel-Session": session})
    assert r.status_code == 200, r.text
    return r.headers["X-Flywheel-Generation"]


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


def test_rejected_requests_get_envelopes_and_leave_the_bus_untouched(client, bus, settings, upstream):
    # One generation and one accepted feedback first: they must survive everything that follows, once.
    generation = _chat(client, "s-1")
    served = upstream.served
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

    err = _envelope(client.post(CHAT, json={"messages": GOOD_MESSAGES, "model": "gpt-nope"}), 404)
    assert err["param"] == "model" and err["code"] == "model_not_found" and "tiny-sim" in err["message"]

    # Feedback on what this tenant never received.
    err = _envelope(client.post("/v1/feedback", json=dict(fb, generation_id="g-never")), 404)
    assert err["code"] == "generation_not_found" and err["param"] == "generation_id"
    err = _envelope(client.post("/v1/feedback", json=dict(fb, session_id="s-never")), 404)
    assert err["code"] == "session_not_found"
    err = _envelope(client.post("/v1/feedback", json=dict(fb, generation_id=generation, session_id="s-other")), 400)
    assert err["code"] == "session_mismatch"

    assert upstream.served == served  # nothing rejected reached the upstream
    seen = _drain(client, bus, settings, "check-1")
    assert [json.loads(v)["generation_id"] for v in seen[settings.topic("generations")]] == [generation]
    values = seen[settings.topic("feedback")]
    assert len(values) == 1
    event = FeedbackEvent.from_bytes(values[0])
    assert (event.event_id, event.feedback_id, event.session_id, event.signal) == (expected_id, "fb-1", "s-1", "thumbs")


def test_feedback_batches_and_retries_keep_their_ids(client, bus, settings):
    generation = _chat(client, "s-9")
    items = [
        {"feedback_id": "r-1", "kind": "outcome", "signal": "task_solved", "value": 1, "generation_id": generation},
        {"feedback_id": "r-2", "kind": "custom", "signal": "latency_complaint", "data": {"ms": 900}},
    ]
    first = client.post("/v1/feedback", json={"feedback": items}, headers={"X-Flywheel-Session": "s-9"})
    retry = client.post("/v1/feedback", json={"feedback": items}, headers={"X-Flywheel-Session": "s-9"})
    assert first.status_code == retry.status_code == 202
    assert first.json() == retry.json()
    tenant = settings.gateway.default_tenant
    assert first.json()["event_ids"] == [feedback_event_id(tenant, "r-1"), feedback_event_id(tenant, "r-2")]

    events = [FeedbackEvent.from_bytes(v) for v in _drain(client, bus, settings, "check-2")[settings.topic("feedback")]]
    # At-least-once on the bus; the ids make the retry a duplicate that consumers drop.
    assert sorted(e.event_id for e in events) == sorted(first.json()["event_ids"] * 2)
    assert {e.session_id for e in events} == {"s-9"}
    assert {e.data["ms"] for e in events if e.kind == "custom"} == {900}

    metrics = client.get("/metrics").text
    assert "flywheel_feedback_captured_total 4.0" in metrics
    assert 'flywheel_generations_captured_total{model_version="1"} 1.0' in metrics


def test_unreachable_upstream_is_a_502_and_nothing_is_captured(tmp_path):
    settings = load_settings(data_dir=str(tmp_path), gateway={"upstream": f"http://127.0.0.1:{free_port()}"})
    bus = make_bus(settings)
    with TestClient(create_app(settings)) as client:
        r = client.post(CHAT, json={"messages": GOOD_MESSAGES}, headers={"X-Flywheel-Session": "s-2"})
        err = _envelope(r, 502)
        assert err["type"] == "upstream_error" and err["code"] == "upstream_unreachable"
        assert r.headers["X-Flywheel-Session"] == "s-2"
        assert _drain(client, bus, settings, "check-3")[settings.topic("generations")] == []
        assert client.get("/health").json()["status"] == "ok"
    bus.close()


@pytest.mark.parametrize("policy", ["reject", "drop"])
def test_a_full_spool_applies_its_policy(tmp_path, upstream, policy):
    """The bus refuses everything, so the spool fills; then ``reject`` answers 503 before calling
    the upstream and ``drop`` keeps serving and counts each lost event."""
    settings = load_settings(data_dir=str(tmp_path), gateway={
        "upstream": upstream.url, "spool_max_bytes": 65_536, "spool_full": policy, "drain_timeout_s": 0})
    with TestClient(create_app(settings, producer_factory=RefusingProducer)) as client:
        statuses = [client.post(CHAT, json={"messages": GOOD_MESSAGES}).status_code for _ in range(40)]
        depth = client.get("/admin/capture").json()
        metrics = client.get("/metrics").text
    assert depth["bytes"] >= 65_536 * 0.9
    if policy == "reject":
        assert statuses[0] == 200 and statuses[-1] == 503 and set(statuses) == {200, 503}
        assert statuses.index(503) < 40 and all(s == 503 for s in statuses[statuses.index(503):])
    else:
        assert set(statuses) == {200}
        dropped = sum(float(line.split()[-1]) for line in metrics.splitlines()
                      if line.startswith("flywheel_capture_dropped_total"))
        accepted = float(next(line.split()[-1] for line in metrics.splitlines()
                              if line.startswith("flywheel_generations_captured_total")))
        assert dropped >= 1 and dropped + accepted == 40


def test_hostile_bodies_get_a_400_never_a_500(tmp_path):
    """Nesting past the parser's recursion limit, nesting the event could not serialise, control
    characters in ids and session headers, non-finite values, out-of-range seeds."""
    settings = load_settings(data_dir=str(tmp_path), gateway={"upstream": "http://127.0.0.1:9"})
    bus = make_bus(settings)
    with TestClient(create_app(settings)) as client:
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
