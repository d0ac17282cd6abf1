"""The serving stage over real HTTP: node (built-in engine, quick tiny model) + gateway + bus + registry.

The node and the gateway run through their real entry points (``run(settings, stop)``) in threads,
on free ports, with a local-log bus, Redis live state (node heartbeats) and the database from
``migrated_db_url`` (SQLite and PostgreSQL). The test publishes versions with its own
:class:`Registry` on the same database and store, exactly as the trainer would, and watches the
node pick them up. Node-only tests (several versions per node) run without the gateway.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import torch

from flywheel import lm
from flywheel.bus import make_bus
from flywheel.db.models import Node
from flywheel.db.session import make_engine, make_session_factory
from flywheel.events import FeedbackEvent, GenerationEvent, feedback_event_id
from flywheel.settings import Settings, load_settings
from flywheel.weights.registry import Registry
from flywheel.weights.store import make_store
from testbed.procs import free_port
from tests.fixtures.roles import MESSAGES, RoleThread, wait_until

pytestmark = pytest.mark.integration



@pytest.fixture(scope="session")
def quick_model_dir(tiny_model_dir):
    """The quick tiny model (built once per test session by tests/fixtures/model.py)."""
    return tiny_model_dir


@pytest.fixture(scope="session")
def reference(quick_model_dir):
    """An independent copy of the model, to recompute logprobs from served token ids."""
    model, tokenizer = lm.load_model(quick_model_dir)
    return model, tokenizer


@dataclass
class Stack:
    settings: Settings
    node: str
    gateway: str | None
    registry: Registry
    sessions: Any
    bus: Any

    def chat(self, client: httpx.Client, **body: Any) -> httpx.Response:
        body.setdefault("messages", MESSAGES)
        body.setdefault("model", self.settings.model.line)
        return client.post(f"{self.gateway}/v1/chat/completions", json=body)

    def health(self) -> dict[str, Any]:
        return httpx.get(f"{self.node}/health", timeout=5).json()

    def events(self, topic: str, group: str, want: int, timeout_s: float = 10.0) -> list[bytes]:
        consumer = self.bus.consumer(group, [self.settings.topic(topic)])
        got: list[bytes] = []
        try:
            deadline = time.monotonic() + timeout_s
            while len(got) < want and time.monotonic() < deadline:
                got += [r.value for r in consumer.poll(timeout_s=0.2, max_records=1000)]
            got += [r.value for r in consumer.poll(timeout_s=0.2, max_records=1000)]  # and nothing more
        finally:
            consumer.close()
        return got


@contextlib.contextmanager
def running(data_dir, db_url: str, model_dir, live: dict[str, Any], *, gateway: bool) -> Iterator[Stack]:
    """The node (and the gateway, when asked) through their entry points until the block ends."""
    from serving.gateway.main import run as run_gateway
    from serving.node.main import run as run_node

    settings = load_settings(
        data_dir=str(data_dir),
        db={"url": db_url, "wait_s": 10},
        bus={"kind": "local", "partitions": 2, "topic_prefix": f"it-{uuid.uuid4().hex[:8]}."},
        model={"path": str(model_dir)},
        live=live,
        node={"port": free_port(), "poll_s": 0.2, "node_id": "node-it", "max_new_tokens": 16, "keep_versions": 3},
        gateway={"port": free_port()},
    )
    stop = threading.Event()
    roles = [RoleThread("node", run_node, settings, stop)]
    if gateway:
        roles.append(RoleThread("gateway", run_gateway, settings, stop))
    node_url = f"http://127.0.0.1:{settings.node.port}"
    gateway_url = f"http://127.0.0.1:{settings.gateway.port}"
    db = make_engine(db_url)
    sessions = make_session_factory(db)
    bus = make_bus(settings)
    try:
        for role in roles:
            role.start()

        def up(url: str, thread: RoleThread) -> bool:
            if thread.error is not None:
                raise AssertionError(f"{thread.name} failed to start: {thread.error!r}") from thread.error
            return httpx.get(url, timeout=2).status_code == 200

        wait_until("the node", lambda: up(f"{node_url}/health", roles[0]), timeout_s=120)
        if gateway:
            wait_until("the gateway", lambda: up(f"{gateway_url}/health", roles[1]))
        registry = Registry(sessions, make_store(settings), settings.model.line)
        yield Stack(settings, node_url, gateway_url if gateway else None, registry, sessions, bus)
    finally:
        stop.set()
        for role in roles:
            role.join(timeout=30)
        bus.close()
        db.dispose()
    for role in roles:
        assert not role.is_alive(), f"{role.name} did not stop"
        assert role.error is None, role.error


@pytest.fixture
def stack(tmp_path, migrated_db_url, quick_model_dir, redis_url, live_prefix) -> Iterator[Stack]:
    live = {"kind": "redis", "redis_url": redis_url, "key_prefix": live_prefix}
    with running(tmp_path, migrated_db_url, quick_model_dir, live, gateway=True) as stack:
        yield stack


@pytest.fixture
def node_stack(tmp_path, migrated_db_url, quick_model_dir, redis_url, live_prefix) -> Iterator[Stack]:
    """The node alone (Redis live state, so the test reads its heartbeats)."""
    live = {"kind": "redis", "redis_url": redis_url, "key_prefix": live_prefix}
    with running(tmp_path, migrated_db_url, quick_model_dir, live, gateway=False) as stack:
        yield stack


def _served_logprobs_match(reference, state, event: GenerationEvent) -> float:
    """Largest gap between served logprobs and a fresh full forward pass over the served ids."""
    model, _ = reference
    lm.load_state(model, state)
    tokens = event.prompt_token_ids + event.completion_token_ids
    recomputed = lm.token_logprobs(model, tokens)[len(event.prompt_token_ids) - 1 :]
    assert len(recomputed) == len(event.completion_logprobs)
    return max(abs(a - b) for a, b in zip(recomputed, event.completion_logprobs, strict=True))


def test_gateway_captures_generations_and_feedback(stack, reference):
    _, tokenizer = reference
    with httpx.Client(timeout=60) as client:
        plain = stack.chat(client, max_tokens=12)
        assert plain.status_code == 200, plain.text
        session = plain.headers["X-Flywheel-Session"]
        generation = plain.headers["X-Flywheel-Generation"]
        assert plain.headers["X-Flywheel-Model-Version"] == "0"
        body = plain.json()
        assert body["object"] == "chat.completion" and body["model_version"] == 0
        choice = body["choices"][0]
        assert choice["message"]["role"] == "assistant" and choice["finish_reason"] in ("stop", "length")
        # The client asked for neither logprobs nor token ids: the gateway strips what it forced on.
        assert choice["logprobs"] is None and "token_ids" not in choice and "prompt_token_ids" not in body

        r = client.post(
            f"{stack.gateway}/v1/chat/completions",
            json={"messages": MESSAGES, "max_tokens": 12, "logprobs": True, "return_token_ids": True},
            headers={"X-Flywheel-Session": "sess-A"},
        )
        assert r.status_code == 200 and r.headers["X-Flywheel-Session"] == "sess-A"
        rich = r.json()
        content = rich["choices"][0]["logprobs"]["content"]
        assert len(content) == len(rich["choices"][0]["token_ids"]) == rich["usage"]["completion_tokens"]
        assert all(set(e) == {"token", "logprob", "bytes", "top_logprobs"} and e["top_logprobs"] == [] for e in content)
        assert rich["prompt_token_ids"] == lm.chat_prompt_ids(tokenizer, MESSAGES)

        fb = client.post(
            f"{stack.gateway}/v1/feedback",
            json={"feedback_id": "fb-it-1", "session_id": session, "generation_id": generation,
                  "kind": "outcome", "signal": "task_solved", "value": 1},
        )
        assert fb.status_code == 202

    events = [GenerationEvent.from_bytes(v) for v in stack.events("generations", "g1", want=2)]
    assert len(events) == 2
    by_session = {e.session_id: e for e in events}
    first, second = by_session[session], by_session["sess-A"]
    assert first.generation_id == generation and first.model_version == 0 and first.node_id == "node-it"
    assert first.model_line == stack.settings.model.line and first.tenant == "local"
    assert first.request["max_tokens"] == 12 and "logprobs" not in first.request  # the client's body, untouched
    assert first.sampling.temperature == 1.0 and first.sampling.max_tokens == 12
    assert first.latency_ms > 0
    for event in events:
        assert event.prompt_token_ids == lm.chat_prompt_ids(tokenizer, MESSAGES)
        assert len(event.completion_token_ids) == len(event.completion_logprobs) in range(1, 13)
        assert all(lp <= 0.0 and math.isfinite(lp) for lp in event.completion_logprobs)
        assert event.response["choices"][0]["token_ids"] == event.completion_token_ids
    # The text the client saw is the decoding of the captured ids (no re-tokenisation anywhere).
    assert second.completion_token_ids == rich["choices"][0]["token_ids"]
    assert rich["choices"][0]["message"]["content"] == lm.completion_text(tokenizer, second.completion_token_ids)
    # The served logprobs are the model's own log-probabilities of the served ids (temperature 1).
    base = stack.registry.load(0)
    assert _served_logprobs_match(reference, base, second) < 1e-3

    feedback = [FeedbackEvent.from_bytes(v) for v in stack.events("feedback", "f1", want=1)]
    assert [(f.event_id, f.generation_id, f.session_id, f.signal) for f in feedback] == [
        (feedback_event_id("local", "fb-it-1"), generation, session, "task_solved")
    ]
    metrics = httpx.get(f"{stack.gateway}/metrics").text
    assert 'flywheel_generations_captured_total{model_version="0"} 2.0' in metrics
    assert "flywheel_feedback_captured_total 1.0" in metrics


def test_concurrent_requests_are_batched_and_all_captured(stack):
    n = 8
    before = stack.health()["engine"]
    with httpx.Client(timeout=60) as client, concurrent.futures.ThreadPoolExecutor(n) as pool:
        responses = list(pool.map(lambda i: stack.chat(client, max_tokens=8), range(n)))
    assert [r.status_code for r in responses] == [200] * n
    events = [GenerationEvent.from_bytes(v) for v in stack.events("generations", "g2", want=n)]
    assert sorted(e.generation_id for e in events) == sorted(r.headers["X-Flywheel-Generation"] for r in responses)
    assert {e.session_id for e in events} == {r.headers["X-Flywheel-Session"] for r in responses}
    after = stack.health()["engine"]
    assert after["requests"] - before["requests"] == n
    assert after["batches"] - before["batches"] < n  # concurrent requests shared generate calls


def test_node_rejects_unsupported_options_through_the_gateway(stack):
    with httpx.Client(timeout=60) as client:
        r = stack.chat(client, top_logprobs=3)
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
        r = stack.chat(client, model="gpt-4o")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = client.post(f"{stack.node}/v1/chat/completions", json={"messages": MESSAGES, "n": 9})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"  # above node.max_n
        r = stack.chat(client, messages=[{"role": "system", "content": "be brief"}, *MESSAGES])
        assert r.status_code == 400 and "only user and assistant" in r.json()["error"]["message"]
        r = stack.chat(client, max_tokens=100_000)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert stack.events("generations", "g3", want=0, timeout_s=0.5) == []


def _perturbed(state: dict[str, torch.Tensor], seed: int, fraction: float = 0.05) -> dict[str, torch.Tensor]:
    """A sparse update: a random few percent of entries of every matrix nudged (bf16, like training)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        t = t.clone()
        if t.dim() >= 2:
            mask = torch.rand(t.shape, generator=gen) < fraction
            noise = (torch.randn(t.shape, generator=gen) * 0.5).to(t.dtype)
            t = torch.where(mask, t + noise, t)
        out[name] = t
    return out


def _node_row(stack: Stack) -> Node:
    with stack.sessions() as session:
        row = session.get(Node, "node-it")
        assert row is not None
        return row


def test_updater_hot_swaps_deltas_and_rejects_a_corrupt_one(stack, reference):
    registry = stack.registry
    v0 = registry.get(0)
    assert (v0.kind, v0.status, v0.sha256) == ("full", "stable", stack.health()["sha256"])

    state0 = registry.load(0)
    state1 = _perturbed(state0, seed=1)
    v1 = registry.publish(state1, parent=0, parent_state=state0)
    assert v1.kind == "delta" and v1.bytes < v1.full_bytes
    registry.set_status(v1.version, "stable", reason="test")
    health = wait_until("the node on v1", lambda: (h := stack.health())["version"] == 1 and h)
    assert health["sha256"] == v1.sha256 and health["update_status"] == "serving"
    assert wait_until("the nodes row", lambda: _node_row(stack).live_version == 1)

    with httpx.Client(timeout=60) as client:
        r = stack.chat(client, max_tokens=12)
    assert r.status_code == 200 and r.json()["model_version"] == 1 and r.headers["X-Flywheel-Model-Version"] == "1"
    event = next(
        e for e in map(GenerationEvent.from_bytes, stack.events("generations", "g4", want=1))
        if e.generation_id == r.headers["X-Flywheel-Generation"]
    )
    assert event.model_version == 1
    # Sampled by v1's weights: its logprobs match v1 and not v0.
    assert _served_logprobs_match(reference, state1, event) < 1e-3
    assert _served_logprobs_match(reference, state0, event) > 1e-3

    # A delta whose bytes rot in the store: the node refuses it and keeps serving v1.
    state2 = _perturbed(state1, seed=2)
    v2 = registry.publish(state2, parent=1, parent_state=state1)
    assert v2.kind == "delta"
    blob = bytearray(registry.store.get(v2.store_key))
    for i in range(len(blob) // 2, len(blob) // 2 + 64):
        blob[i] ^= 0xFF
    registry.store.put(v2.store_key, bytes(blob))
    registry.set_status(v2.version, "stable", reason="test: corrupt")
    health = wait_until("the failed update", lambda: (h := stack.health())["update_status"] == "failed_update" and h)
    assert health["version"] == 1 and health["sha256"] == v1.sha256
    assert "version 2" in health["update_detail"]
    row = wait_until("the nodes row", lambda: (n := _node_row(stack)).status == "failed_update" and n)
    assert row.live_version == 1 and "version 2" in row.detail
    with httpx.Client(timeout=60) as client:
        r = stack.chat(client, max_tokens=4)
    assert r.status_code == 200 and r.json()["model_version"] == 1

    # The admin API retries on demand and reports the failure, still on v1.
    r = httpx.post(f"{stack.node}/admin/update_weights", json={"version": 2}, timeout=60)
    assert r.status_code == 409 and "still serving version 1" in r.json()["error"]["message"]

    # A good version built on v1 is taken, and the node is healthy again.
    state3 = _perturbed(state1, seed=3)
    v3 = registry.publish(state3, parent=1, parent_state=state1)
    registry.set_status(v3.version, "stable", reason="test: recovery")
    health = wait_until("the node on v3", lambda: (h := stack.health())["version"] == 3 and h)
    assert health["sha256"] == v3.sha256 and health["update_status"] == "serving"


# Several versions per node (sticky sessions) ------------------------------------------------------


def _logprob_gap(reference, state: dict[str, torch.Tensor], prompt_ids: list[int], ids: list[int],
                 logprobs: list[float]) -> float:
    """Largest gap between served logprobs and a fresh forward pass of ``state`` over the served ids."""
    model, _ = reference
    lm.load_state(model, state)
    recomputed = lm.token_logprobs(model, prompt_ids + ids)[len(prompt_ids) - 1 :]
    return max(abs(a - b) for a, b in zip(recomputed, logprobs, strict=True))


def test_a_batch_never_mixes_versions_and_eviction_spares_the_live_one(tmp_path, quick_model_dir, reference):
    from flywheel.weights.codec.state import state_sha256
    from serving.node.engine import Engine, GenerationRequest, VersionUnavailable

    settings = load_settings(data_dir=str(tmp_path), node={"keep_versions": 2})
    engine = Engine(quick_model_dir, settings, version=0, max_batch=64, batch_window_s=0.5)
    try:
        state0 = engine.state()
        state1 = _perturbed(state0, seed=1)
        engine.swap(1, state1, state_sha256(state1))
        assert (engine.versions(), engine.current()) == ([0, 1], (1, state_sha256(state1)))
        prompt = engine.prompt_ids(MESSAGES)
        wanted = [0, 1, None] * 8
        futures = [engine.submit(GenerationRequest(prompt, 6, version=v)) for v in wanted]
        completions = [c for f in futures for c in f.result(timeout=60)]
        assert engine.batches == 2 and engine.requests == len(wanted)  # one generate call per version
        states = {0: state0, 1: state1}
        for asked, completion in zip(wanted, completions, strict=True):
            version = 1 if asked is None else asked
            assert (completion.version, completion.sha256) == (version, state_sha256(states[version]))
            own = _logprob_gap(reference, states[version], prompt, completion.token_ids, completion.logprobs)
            other = _logprob_gap(reference, states[1 - version], prompt, completion.token_ids, completion.logprobs)
            assert own < 1e-3 < other, (version, own, other)

        # A request queued for a version that is evicted before its batch runs is told what is held.
        queued = engine.submit(GenerationRequest(prompt, 4, version=0))
        state2 = _perturbed(state1, seed=2)
        engine.swap(2, state2, state_sha256(state2))  # keeps 2: evicts 0, the least recently used
        with pytest.raises(VersionUnavailable) as err:
            queued.result(timeout=60)
        assert err.value.held == [1, 2]
        with pytest.raises(VersionUnavailable):
            engine.submit(GenerationRequest(prompt, 4, version=0))
        # Holding a version beside the live one evicts the other one, never the live one.
        engine.swap(0, state0, state_sha256(state0), live=False)
        assert (engine.versions(), engine.current()[0]) == ([0, 2], 2)
        assert engine.activate(0) and engine.current() == (0, state_sha256(state0)) and not engine.activate(1)
        with pytest.raises(ValueError, match="held with hash"):
            engine.swap(2, state1, state_sha256(state1))  # a held version is immutable
    finally:
        engine.close()


def test_the_node_serves_each_held_version_and_409s_an_evicted_one(node_stack, reference):
    stack = node_stack
    import asyncio

    from flywheel.live import RedisLive
    from serving.gateway.routing import Router

    registry = stack.registry
    state0 = registry.load(0)
    state1 = _perturbed(state0, seed=1)
    registry.set_status(registry.publish(state1, parent=0, parent_state=state0).version, "stable", reason="test")
    wait_until("the node on v1", lambda: (h := stack.health())["version"] == 1 and h["versions"] == [0, 1])

    def ask(client: httpx.Client, version: str | None) -> httpx.Response:
        headers = {} if version is None else {"X-Flywheel-Model-Version": version}
        body = {"messages": MESSAGES, "max_tokens": 8, "logprobs": True, "return_token_ids": True}
        return client.post(f"{stack.node}/v1/chat/completions", json=body, headers=headers)

    def served(r: httpx.Response, version: int, state, other) -> None:
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model_version"] == version and r.headers["X-Flywheel-Model-Version"] == str(version)
        choice = body["choices"][0]
        logprobs = [e["logprob"] for e in choice["logprobs"]["content"]]
        args = (body["prompt_token_ids"], choice["token_ids"], logprobs)
        assert _logprob_gap(reference, state, *args) < 1e-3 < _logprob_gap(reference, other, *args)

    with httpx.Client(timeout=60) as client:
        served(ask(client, "0"), 0, state0, state1)
        served(ask(client, "1"), 1, state1, state0)
        served(ask(client, None), 1, state1, state0)  # no header: the live version
        r = ask(client, "latest")
        assert r.status_code == 400 and r.json()["error"]["param"] == "X-Flywheel-Model-Version"

    # A canary is held beside the live version, not served by default.
    state2 = _perturbed(state1, seed=2)
    registry.set_status(registry.publish(state2, parent=1, parent_state=state1).version, "canary", reason="test")
    wait_until("the canary held", lambda: (h := stack.health())["versions"] == [0, 1, 2] and h["version"] == 1)
    # A new stable version evicts the least recently used one (keep_versions = 3).
    state3 = _perturbed(state1, seed=3)
    registry.set_status(registry.publish(state3, parent=1, parent_state=state1).version, "stable", reason="test")
    wait_until("the node on v3", lambda: (h := stack.health())["version"] == 3 and h["versions"] == [1, 2, 3])
    with httpx.Client(timeout=60) as client:
        served(ask(client, "2"), 2, state2, state1)
        r = ask(client, "0")
        assert r.status_code == 409, r.text
        error = r.json()["error"]
        assert error["code"] == "version_unavailable" and "[1, 2, 3]" in error["message"]

    # The gateway's router sees what the node holds through its heartbeat.
    settings = stack.settings.model_copy(update={"gateway": stack.settings.gateway.model_copy(
        update={"upstream": "http://fallback.invalid"})})
    live = RedisLive(settings.live.redis_url, settings.live.key_prefix)

    async def route() -> tuple:
        router = Router(settings, stack.sessions, live)
        await router.refresh()
        table = await router.table()
        return (table.stable, table.canary), router.upstream_for(2), router.upstream_for(0), router.live_versions()

    try:
        statuses, for_canary, for_evicted, shown = asyncio.run(route())
    finally:
        live.close()
    assert statuses == (3, 2) and for_canary == stack.node and for_evicted == "http://fallback.invalid"
    assert shown["nodes"] == [{"node_id": "node-it", "region": "local", "live_version": 3, "versions": [1, 2, 3],
                               "status": "serving"}]

    # A rollback to a version the node still holds needs no load.
    registry.set_status(1, "stable", reason="test: rollback")
    health = wait_until("the node back on v1", lambda: (h := stack.health())["version"] == 1 and h)
    assert health["versions"] == [1, 2, 3] and "already held" in health["update_detail"]
