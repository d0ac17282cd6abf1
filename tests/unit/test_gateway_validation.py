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
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from bench.upstream import running
from flywheel.bus import make_bus
from flywheel.events import FeedbackEvent, feedback_event_id
from flywheel.settings import load_settings
from serving.gateway.app import create_app
from testbed.procs import free_port
from tests.fixtures.roles import RefusingProducer, wait_until

pytestmark = pytest.mark.unit


#: The custom metrics these tests send feedback about (an undeclared custom signal is a 400).
METRICS = {
    "latency_complaint": {"type": "boolean", "level": "session", "direction": "min"},
    "x": {"type": "boolean", "level": "session", "direction": "max"},
    "helpfulness": {"type": "float", "level": "generation", "direction": "max", "min": 0, "max": 5},
    "notes": {"type": "comment", "level": "session"},
}


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
        metrics={"declared": METRICS},
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

    # Every sampling knob in its range (vLLM's), or a 400 naming it.
    for field, value in [("top_k", -2), ("top_k", 2.5), ("min_p", 1.5), ("repetition_penalty", 0.0),
                         ("presence_penalty", 2.5), ("frequency_penalty", -3), ("top_p", 0.0),
                         ("logit_bias", {"12": 150}), ("logit_bias", {"twelve": 1}), ("logit_bias", [1, 2]),
                         ("n", 9), ("n", 0)]:
        err = _envelope(client.post(CHAT, json={"messages": GOOD_MESSAGES, field: value}), 400)
        assert err["param"] == field, (field, value, err)

    err = _envelope(client.post(CHAT, json={"messages": GOOD_MESSAGES, "n": 9}), 400)
    assert err["param"] == "n" and "at most 8" in err["message"]  # gateway.max_n

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


# --- issue 21: the JSON policy at the edge, honest answers ----------------------------------------

BIG = "9" * 4000


def test_the_poison_pill_request_is_a_400_naming_the_field(client, bus, settings):
    """The exact request that once stopped ingest for every tenant: an integer of 4,000 digits in
    feedback ``data``. Then NaN/Infinity in every free-form field, and repeated keys."""
    generation = _chat(client, "s-p")
    raw = (f'{{"feedback_id":"d-bigint2","generation_id":"{generation}","kind":"custom","signal":"x",'
           f'"data":{{"a":{BIG}}}}}').encode()
    settings_limit = settings.gateway.max_body_bytes
    assert len(raw) > settings_limit  # this fixture's body limit is small: send it where it fits
    with TestClient(create_app(settings.model_copy(update={
            "gateway": settings.gateway.model_copy(update={"max_body_bytes": 65536, "gateway_id": "gw-big"})}))) as big:
        body = _envelope(big.post("/v1/feedback", content=raw), 400)
        assert body["param"] == "data.a" and "4000 digits" in body["message"]
    for path, raw in [
        ("data.a", b'{"feedback_id":"n1","session_id":"s-p","kind":"custom","signal":"x","data":{"a":NaN}}'),
        ("data.a.1", b'{"feedback_id":"n2","session_id":"s-p","kind":"custom","signal":"x","data":{"a":[1,Infinity]}}'),
        ("data.a", b'{"feedback_id":"n3","session_id":"s-p","kind":"custom","signal":"x","data":{"a":1e400}}'),
        ("force", b'{"force":false,"force":true}'),
        ("metadata.x", b'{"messages":[{"role":"user","content":"x"}],"metadata":{"x":-Infinity}}'),
        ("logit_bias.12", b'{"messages":[{"role":"user","content":"x"}],"logit_bias":{"12":NaN}}'),
        ("frobnicate", b'{"messages":[{"role":"user","content":"x"}],"frobnicate":NaN}'),
        ("messages.0.role", b'{"messages":[{"role":"user","role":"system","content":"x"}]}'),
    ]:
        route = "/v1/feedback" if b"feedback_id" in raw else "/v1/chat/completions"
        error = _envelope(client.post(route, content=raw), 400)
        assert error["param"] == path and error["code"] == "invalid_json", (raw, error)
    seen = _drain(client, bus, settings, "g-poison")
    assert len(seen[settings.topic("generations")]) == 1 and seen[settings.topic("feedback")] == []


def test_a_conflicting_feedback_replay_is_a_409_with_what_is_stored(client, bus, settings):
    generation = _chat(client, "s-r")
    first = {"feedback_id": "c-1", "generation_id": generation, "kind": "explicit", "signal": "thumbs", "value": 1}
    assert client.post("/v1/feedback", json=first).status_code == 202
    assert client.post("/v1/feedback", json=first).status_code == 202  # an identical retry is harmless
    for change in ({"value": -1}, {"kind": "implicit", "signal": "retry", "value": None}, {"data": {"k": 1}},
                   {"generation_id": None, "session_id": "s-r"}):
        r = client.post("/v1/feedback", json={**first, **change})
        assert r.status_code == 409, r.text
        body = r.json()
        assert set(body) == {"error", "stored"}
        assert body["error"]["code"] == "feedback_id_conflict" and body["error"]["param"] == "feedback_id"
        assert body["stored"]["value"] == 1 and body["stored"]["generation_id"] == generation
    # In a batch: the conflicting item is named, and nothing of the batch is accepted.
    batch = {"feedback": [{**first, "feedback_id": "c-2"}, {**first, "value": 0}]}
    conflict = client.post("/v1/feedback", json=batch)
    assert conflict.status_code == 409 and conflict.json()["error"]["param"] == "feedback.1.feedback_id"
    third = {**first, "feedback_id": "c-2", "value": -1}  # c-2 was released: it may carry anything now
    assert client.post("/v1/feedback", json=third).status_code == 202
    # A batch repeating one id is reported, even with identical items.
    twice = {"feedback": [{**first, "feedback_id": "c-3"}, {**first, "feedback_id": "c-3"}]}
    error = _envelope(client.post("/v1/feedback", json=twice), 400)
    assert error["param"] == "feedback.1.feedback_id" and error["code"] == "duplicate_feedback_id"
    seen = _drain(client, bus, settings, "g-replay")
    stored = [FeedbackEvent.from_bytes(v) for v in seen[settings.topic("feedback")]]
    assert {(e.feedback_id, e.value) for e in stored} == {("c-1", 1), ("c-2", -1)}


def test_clearing_a_pin_takes_an_explicit_null(client):
    assert _envelope(client.put("/admin/pins/acme", json={}), 400)["param"] == "version"
    assert client.put("/admin/pins/acme", json={"version": None}).status_code == 200


class _Captured:
    """One gateway for every hypothesis example, and a consumer that reads what it shipped."""

    def __init__(self, client: TestClient, bus: Any, settings: Any) -> None:
        self.client, self.settings, self.count = client, settings, 0
        self.consumer = bus.consumer("g-hypothesis", [settings.topic("generations"), settings.topic("feedback")])
        self.session = "s-h"

    def next(self) -> int:
        self.count += 1
        return self.count

    def drain(self) -> dict[str, list[bytes]]:
        wait_until("the spool to ship", lambda: self.client.get("/admin/capture").json()["events"] == 0, timeout_s=20)
        seen: dict[str, list[bytes]] = {}
        for _ in range(2):
            records = self.consumer.poll(timeout_s=0.05, max_records=1000)
            for record in records:
                seen.setdefault(record.topic, []).append(record.value)
            self.consumer.commit(records)
        return seen


@pytest.fixture(scope="module")
def hyp_client(tmp_path_factory, upstream):
    settings = load_settings(data_dir=str(tmp_path_factory.mktemp("hyp")),
                             bus={"kind": "local", "partitions": 1, "topic_prefix": "h."},
                             gateway={"upstream": upstream.url}, metrics={"declared": METRICS})
    bus = make_bus(settings)
    bus.ensure_topics([settings.topic("generations"), settings.topic("feedback")])
    with TestClient(create_app(settings)) as client:
        captured = _Captured(client, bus, settings)
        _chat(client, captured.session)
        captured.drain()
        yield client, captured
        captured.consumer.close()
    bus.close()


settings_for_hypothesis = hypothesis_settings(max_examples=120, deadline=None, derandomize=True,
                                              suppress_health_check=[HealthCheck.function_scoped_fixture])


# Arbitrary JSON values (hypothesis) through every free-form field of the public API: a 4xx, or
# accepted and then decodable by every consumer and stored and read back unchanged by the database
# layer. Never a 5xx, never a record a consumer cannot read.
_scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
            | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20)
            | st.sampled_from(["\ud800", "a\udfffb", BIG[:30]]))
_json_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4)
                            | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


@settings_for_hypothesis
@given(value=_json_values, where=st.sampled_from(["extra", "logit_bias", "metadata", "data", "tool_args"]))
def test_any_json_in_a_free_form_field_is_refused_or_readable_by_every_consumer(hyp_client, value, where):
    from flywheel.db.session import json_dumps
    from flywheel.events import GenerationEvent
    from flywheel.jsonpolicy import db_loads

    client, capture = hyp_client
    if where == "data":
        route, body = "/v1/feedback", {"feedback_id": f"h-{capture.next()}", "session_id": capture.session,
                                       "kind": "custom", "signal": "x", "data": {"v": value}}
    else:
        body = {"messages": [{"role": "user", "content": "x"}]}
        if where == "extra":
            body["x_extra"] = value
        elif where == "logit_bias":
            body["logit_bias"] = {"12": value}
        elif where == "metadata":
            body["metadata"] = {"k": value}
        else:
            body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                                         "default": value}}}]
        route = "/v1/chat/completions"
    try:
        raw = json.dumps(body).encode("utf-8", "surrogatepass")
    except ValueError:
        return
    r = client.post(route, content=raw, headers={"X-Flywheel-Session": capture.session})
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        return
    for topic, values in capture.drain().items():
        kind = GenerationEvent if topic.endswith("generations") else FeedbackEvent
        for v in values:
            event = kind.from_bytes(v)  # every consumer decodes through this
            dumped = json_dumps(event.model_dump(mode="json"))
            assert db_loads(dumped) == json.loads(event.model_dump_json())


# --- issue 19: declared metrics, session URLs -----------------------------------------------------


def test_feedback_names_a_declared_metric_or_gets_a_400_naming_the_field(client, bus, settings):
    """Each item of a batch is checked against its metric: an unknown name, a wrong type, a value out
    of bounds or a missing generation is a 400 naming the field (``feedback.4.value``), and nothing of
    the batch is accepted; the accepted events carry the metric's name as their signal."""
    generation = _chat(client, "s-m")
    session = {"X-Flywheel-Session": "s-m"}
    good = [
        {"feedback_id": "m-1", "generation_id": generation, "metric": "helpfulness", "value": 4.5},
        {"feedback_id": "m-2", "metric": "latency_complaint", "value": True},
        {"feedback_id": "m-3", "metric": "notes", "comment": "slow today"},
        {"feedback_id": "m-4", "generation_id": generation, "metric": "thumbs", "value": 1},
    ]
    for bad, param, code in [
        ({"metric": "helpfulnes", "value": 1, "generation_id": generation}, "metric", "unknown_metric"),
        ({"kind": "custom", "signal": "vibes"}, "signal", "unknown_metric"),
        ({"metric": "helpfulness", "value": 7, "generation_id": generation}, "value", "invalid_value"),
        ({"metric": "helpfulness", "value": "4", "generation_id": generation}, "value", "invalid_value"),
        ({"metric": "helpfulness", "value": 3}, "generation_id", "missing_required_parameter"),
        ({"metric": "latency_complaint", "value": 0.5}, "value", "invalid_value"),
        ({"metric": "notes"}, "comment", "missing_required_parameter"),
        ({"metric": "notes", "comment": "x", "value": 1}, "value", "invalid_value"),
        ({"metric": "thumbs", "value": True}, "value", "invalid_value"),
        ({"metric": "thumbs", "kind": "custom", "value": 1}, "kind", "invalid_value"),
        ({"metric": "thumbs", "kind": "implicit", "value": 1}, "kind", "invalid_value"),
        ({"metric": "notes", "signal": "x", "comment": "x"}, "signal", "invalid_value"),
        ({"value": 1}, "metric", "missing_required_parameter"),
    ]:
        batch = [*good, {"feedback_id": "m-bad", **bad}]
        err = _envelope(client.post("/v1/feedback", json={"feedback": batch}, headers=session), 400)
        assert (err["param"], err["code"]) == (f"feedback.4.{param}", code), (bad, err)
        assert err["message"].startswith("feedback.4") and err["type"] == "invalid_request_error"
    err = _envelope(client.post("/v1/feedback", json={"feedback_id": "m-5", "metric": "helpfulness", "value": -1,
                                                      "generation_id": generation}), 400)
    assert err["param"] == "value" and "[0, 5]" in err["message"] and "-1" in err["message"]

    first = client.post("/v1/feedback", json={"feedback": good}, headers=session)
    assert first.status_code == 202, first.text
    # The same feedback named the old way (kind + signal), or a boolean as 1: the same content, no conflict.
    again = [{**good[0], "kind": "custom", "signal": "helpfulness"}, {**good[1], "value": 1}, good[2],
             {**{k: v for k, v in good[3].items() if k != "metric"}, "kind": "explicit", "signal": "thumbs"}]
    replay = client.post("/v1/feedback", json={"feedback": again}, headers=session)
    assert replay.status_code == 202 and replay.json() == first.json(), replay.text
    events = {e.feedback_id: e for e in (FeedbackEvent.from_bytes(v) for v in
                                         _drain(client, bus, settings, "g-metrics")[settings.topic("feedback")])}
    assert {f: (e.kind, e.signal, e.value, e.session_id) for f, e in events.items()} == {
        "m-1": ("custom", "helpfulness", 4.5, "s-m"), "m-2": ("custom", "latency_complaint", 1.0, "s-m"),
        "m-3": ("custom", "notes", None, "s-m"), "m-4": ("explicit", "thumbs", 1.0, "s-m")}
    assert events["m-3"].comment == "slow today"


def test_session_urls_are_the_api_with_the_session_taken_from_the_path(client, bus, settings, upstream):
    from flywheel.events import GenerationEvent

    r = client.post("/sessions/s-url/v1/chat/completions", json={"messages": GOOD_MESSAGES})
    assert r.status_code == 200 and r.headers["X-Flywheel-Session"] == "s-url", r.text
    generation = r.headers["X-Flywheel-Generation"]
    r = client.post("/sessions/s-url/v1/completions", json={"prompt": "sort 3 1 2"},
                    headers={"X-Flywheel-Session": "s-url"})  # a header that agrees is fine
    assert r.status_code == 200 and r.headers["X-Flywheel-Session"] == "s-url", r.text
    slash = client.post("/sessions/a%2Fb/v1/chat/completions", json={"messages": GOOD_MESSAGES})
    assert slash.status_code == 200 and slash.headers["X-Flywheel-Session"] == "a/b"
    models = client.get("/sessions/s-url/v1/models")
    assert models.status_code == 200 and models.json()["data"][0]["id"] == settings.model.line
    fb = client.post("/sessions/s-url/v1/feedback", json={"feedback_id": "u-1", "metric": "latency_complaint"})
    assert fb.status_code == 202 and fb.headers["X-Flywheel-Session"] == "s-url", fb.text
    served = upstream.served

    err = _envelope(client.post("/sessions/s-url/v1/chat/completions", json={"messages": GOOD_MESSAGES},
                                headers={"X-Flywheel-Session": "s-other"}), 400)
    assert (err["param"], err["code"]) == ("session_id", "session_mismatch") and "s-other" in err["message"]
    for path in ("/sessions/a%01b/v1/models", "/sessions/a%0D%0AX-Evil:%201/v1/models",
                 f"/sessions/{'x' * 257}/v1/models", "/sessions//v1/models"):
        r = client.get(path)
        assert _envelope(r, 400)["param"] == "session_id", path
        assert "X-Flywheel-Session" not in r.headers and "X-Evil" not in r.headers
    for path in ("/sessions/s-url/health", "/sessions/s-url/admin/capture", "/sessions/s-url", "/sessions/s-url/v2/x"):
        assert _envelope(client.get(path), 404)["type"] == "not_found_error", path
    # A session URL is the header: another tenant's session or a generation of another session is refused alike.
    err = _envelope(client.post("/sessions/s-never/v1/feedback", json={"feedback_id": "u-2", "metric": "x"}), 404)
    assert err["code"] == "session_not_found"
    err = _envelope(client.post("/sessions/s-elsewhere/v1/feedback", json={
        "feedback_id": "u-3", "metric": "thumbs", "value": 1, "generation_id": generation}), 400)
    assert err["code"] == "session_mismatch"
    assert upstream.served == served  # nothing refused reached the upstream

    seen = _drain(client, bus, settings, "g-urls")
    sessions = [GenerationEvent.from_bytes(v).session_id for v in seen[settings.topic("generations")]]
    assert sorted(sessions) == ["a/b", "s-url", "s-url"]
    assert [FeedbackEvent.from_bytes(v).session_id for v in seen[settings.topic("feedback")]] == ["s-url"]
