"""Sticky model versions end to end: the real gateway in front of a real built-in node, following the
real weight registry (PostgreSQL, a local weight folder), with sessions, pins and heartbeats in Redis.

Each test runs its own stack (both entry points in threads, a fresh database, a unique Redis key
prefix, a local-log bus) with ``node.keep_versions = 2`` and ``rollout.canary_fraction = 0.5``, and
moves the registry the way the trainer and the rollout controller do: publish a version (the
previous weights with the final norm scaled, so every logprob changes), then mark it ``stable`` or
``canary``. The node's updater follows within ``node.poll_s``; the gateway sees what the node holds
through its heartbeat within the router's cache (~1 s): :func:`wait_fleet` waits for both, never a
fixed sleep. Every generation a test gets is checked against what the bus received once the
gateway's spool has shipped: one event, naming the version the response header named.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from flywheel.bus import make_bus
from flywheel.events import GenerationEvent
from flywheel.settings import Settings, load_settings
from flywheel.weights.registry import Registry
from serving.gateway.routing import canary_bucket
from testbed.procs import free_port
from tests.fixtures.roles import MESSAGES, RoleThread, wait_until

pytestmark = pytest.mark.integration

TENANT = "local"  # gateway.auth is off: every request acts for gateway.default_tenant
NODE_ID = "node-sticky"
VERSION = "X-Flywheel-Model-Version"
SESSION = "X-Flywheel-Session"
GENERATION = "X-Flywheel-Generation"


@dataclass
class Stack:
    settings: Settings
    gateway: str
    node: str
    registry: Registry
    bus: Any
    http: httpx.Client

    # Requests ------------------------------------------------------------------------------------

    def chat(self, session: str | None = None, **body: Any) -> httpx.Response:
        """One chat completion through the gateway (a new session when ``session`` is None)."""
        headers = {SESSION: session} if session else {}
        r = self.http.post(f"{self.gateway}/v1/chat/completions", headers=headers,
                           json={"messages": MESSAGES, "max_tokens": 2, **body})
        assert r.status_code == 200, r.text
        return r

    def served(self, session: str | None = None, **body: Any) -> tuple[str, int, str]:
        """(session, version named by the response, generation id) of one chat completion."""
        r = self.chat(session, **body)
        return r.headers[SESSION], int(r.headers[VERSION]), r.headers[GENERATION]

    def metric(self, name: str) -> float:
        for family in text_string_to_metric_families(self.http.get(f"{self.gateway}/metrics").text):
            for sample in family.samples:
                if sample.name == name:
                    return sample.value
        raise AssertionError(f"metric {name} not exported")

    def live_versions(self) -> dict[str, Any]:
        r = self.http.get(f"{self.gateway}/v1/models")
        r.raise_for_status()
        return r.json()["data"][0]["flywheel"]

    # The registry ------------------------------------------------------------------------------

    def publish(self, status: str) -> int:
        """A new version on top of the newest one (final norm scaled by 1.25), set to ``status``."""
        parent = self.registry.latest()
        assert parent is not None
        base = self.registry.load(parent.version)
        state = {name: t.clone() for name, t in base.items()}
        state["model.norm.weight"] = (state["model.norm.weight"].float() * 1.25).to(torch.bfloat16)
        info = self.registry.publish(state, parent=parent.version, parent_state=base)
        self.registry.set_status(info.version, status, reason="test")
        return info.version

    def wait_fleet(self, stable: int, canary: int | None, held: set[int]) -> None:
        """Until the node holds exactly ``held`` (live: ``stable``) and the gateway's router sees it."""

        def routed() -> bool:
            shown = self.live_versions()
            (node,) = shown["nodes"]
            return (shown["stable"], shown["canary"], node["live_version"], set(node["versions"])) == (
                stable, canary, stable, held)

        wait_until(f"stable {stable}, canary {canary}, node holding {sorted(held)}", routed, timeout_s=20)

    # What was captured -------------------------------------------------------------------------

    def check_captured(self, served: list[tuple[str, int, str]]) -> None:
        """Each (session, version, generation) has one event on the bus, naming that version and node."""
        wait_until("the spool to ship", lambda: self.http.get(f"{self.gateway}/admin/capture").json()["events"] == 0,
                   timeout_s=20)
        wanted = {generation: (session, version) for session, version, generation in served}
        found: dict[str, dict[str, GenerationEvent]] = {g: {} for g in wanted}
        consumer = self.bus.consumer(f"check-{uuid.uuid4().hex[:8]}", [self.settings.topic("generations")])
        deadline = time.monotonic() + 20
        try:  # the whole topic, until every generation is found and nothing more comes
            while True:
                records = consumer.poll(timeout_s=0.3, max_records=1000)
                for record in records:
                    event = GenerationEvent.from_bytes(record.value)
                    if event.generation_id in found:
                        found[event.generation_id][event.event_id] = event  # at least once: dedup by id
                if (not records and all(found.values())) or time.monotonic() > deadline:
                    break
        finally:
            consumer.close()
        for generation, (session, version) in wanted.items():
            events = list(found[generation].values())
            assert len(events) == 1, (generation, events)
            (event,) = events
            assert (event.session_id, event.model_version, event.node_id, event.tenant) == (
                session, version, NODE_ID, TENANT), generation


@contextlib.contextmanager
def running_stack(data_dir: Path, model_dir: Path, db_url: str, redis_url: str, key_prefix: str) -> Iterator[Stack]:
    from flywheel.db.session import make_engine, make_session_factory, upgrade
    from flywheel.weights.store import make_store
    from serving.gateway.main import run as run_gateway
    from serving.node.main import run as run_node

    upgrade(db_url)  # once, before two roles would race to migrate
    settings = load_settings(
        data_dir=str(data_dir),
        db={"url": db_url, "wait_s": 10},
        live={"kind": "redis", "redis_url": redis_url, "key_prefix": key_prefix},
        bus={"kind": "local", "partitions": 1, "topic_prefix": f"sticky-{uuid.uuid4().hex[:8]}."},
        model={"path": str(model_dir)},
        node={"port": free_port(), "poll_s": 0.2, "node_id": NODE_ID, "max_new_tokens": 4, "keep_versions": 2},
        gateway={"port": free_port()},
        rollout={"canary_fraction": 0.5},
    )
    db = make_engine(db_url)
    registry = Registry(make_session_factory(db), make_store(settings), settings.model.line)
    stop = threading.Event()
    roles = [RoleThread("node", run_node, settings, stop), RoleThread("gateway", run_gateway, settings, stop)]
    bus = make_bus(settings)
    try:
        with httpx.Client(timeout=60) as http:
            for role in roles:
                role.start()

            def up(url: str, role: RoleThread) -> bool:
                if role.error is not None:
                    raise AssertionError(f"{role.name} failed to start: {role.error!r}") from role.error
                return http.get(url, timeout=2).status_code == 200

            node = f"http://127.0.0.1:{settings.node.port}"
            gateway = f"http://127.0.0.1:{settings.gateway.port}"
            wait_until("the node", lambda: up(f"{node}/health", roles[0]), timeout_s=120)
            wait_until("the gateway", lambda: up(f"{gateway}/health", roles[1]))
            stack = Stack(settings, gateway, node, registry, bus, http)
            stack.wait_fleet(stable=0, canary=None, held={0})  # the node bootstrapped version 0
            yield stack
    finally:
        stop.set()
        for role in roles:
            role.join(timeout=30)
        bus.close()
        db.dispose()
    for role in roles:
        assert not role.is_alive() and role.error is None, (role.name, role.error)


@pytest.fixture
def stack(tmp_path, tiny_model_dir, pg_url, redis_url, live_prefix) -> Iterator[Stack]:
    with running_stack(tmp_path, tiny_model_dir, pg_url, redis_url, live_prefix) as s:
        yield s


def _logprobs(response: httpx.Response) -> list[float]:
    return [e["logprob"] for e in response.json()["choices"][0]["logprobs"]["content"]]


def test_a_session_keeps_its_version_after_a_promotion(stack):
    seeded = {"seed": 7, "logprobs": True, "max_tokens": 4}
    a, version, g1 = stack.served(**seeded)
    assert version == 0

    assert stack.publish("stable") == 1
    stack.wait_fleet(stable=1, canary=None, held={0, 1})
    r = stack.chat(a, **seeded)
    assert r.headers[VERSION] == "0"
    # Really served by version 0: the node asked for each version directly gives v0's logprobs, not v1's.
    direct = {v: stack.http.post(f"{stack.node}/v1/chat/completions", headers={VERSION: str(v)},
                                 json={"messages": MESSAGES, **seeded}) for v in (0, 1)}
    assert [d.headers[VERSION] for d in direct.values()] == ["0", "1"]
    assert _logprobs(r) == _logprobs(direct[0]) != _logprobs(direct[1])

    with stack.http.stream("POST", f"{stack.gateway}/v1/chat/completions", headers={SESSION: a},
                           json={"messages": MESSAGES, "max_tokens": 2, "stream": True}) as streamed:
        assert streamed.status_code == 200 and streamed.headers[VERSION] == "0"
        assert streamed.read().endswith(b"data: [DONE]\n\n")
        g3 = streamed.headers[GENERATION]

    b, version_b, g4 = stack.served()
    assert version_b == 1
    assert stack.served(b)[1] == 1 and stack.served(a)[1] == 0
    assert stack.metric("flywheel_sessions_repinned_total") == 0
    stack.check_captured([(a, 0, g1), (a, 0, r.headers[GENERATION]), (a, 0, g3), (b, 1, g4)])


def test_a_session_whose_version_no_node_holds_moves_to_stable(stack):
    a, version, g1 = stack.served()
    c, version_c, g2 = stack.served()
    assert version == version_c == 0
    stack.publish("stable")
    stack.wait_fleet(stable=1, canary=None, held={0, 1})
    _, version, g3 = stack.served(a)
    assert version == 0  # still held: sticky
    assert stack.metric("flywheel_sessions_repinned_total") == 0

    assert stack.publish("stable") == 2
    stack.wait_fleet(stable=2, canary=None, held={1, 2})  # keep_versions=2 evicted version 0
    seeded = {"seed": 3, "logprobs": True, "max_tokens": 4}
    r = stack.chat(a, **seeded)
    assert r.headers[VERSION] == "2"
    assert stack.metric("flywheel_sessions_repinned_total") == 1
    direct = stack.http.post(f"{stack.node}/v1/chat/completions", headers={VERSION: "2"},
                             json={"messages": MESSAGES, **seeded})
    assert _logprobs(r) == _logprobs(direct)  # served by version 2 for real
    _, version, g5 = stack.served(a)  # the session now lives on version 2: no second move
    assert version == 2 and stack.metric("flywheel_sessions_repinned_total") == 1

    # A stream moves the same way, before its first byte.
    with stack.http.stream("POST", f"{stack.gateway}/v1/chat/completions", headers={SESSION: c},
                           json={"messages": MESSAGES, "max_tokens": 2, "stream": True}) as streamed:
        assert streamed.status_code == 200 and streamed.headers[VERSION] == "2"
        assert streamed.read().endswith(b"data: [DONE]\n\n")
        g6 = streamed.headers[GENERATION]
    assert stack.metric("flywheel_sessions_repinned_total") == 2
    stack.check_captured([(a, 0, g1), (c, 0, g2), (a, 0, g3), (a, 2, r.headers[GENERATION]), (a, 2, g5), (c, 2, g6)])


def test_a_canary_gets_its_share_of_new_sessions_and_keeps_them(stack):
    assert stack.publish("canary") == 1
    stack.wait_fleet(stable=0, canary=1, held={0, 1})  # the updater preloads the canary beside stable
    n = 200
    first = [stack.served() for _ in range(n)]
    split = Counter(version for _, version, _ in first)
    assert set(split) == {0, 1} and 60 <= split[1] <= 140, split  # Binomial(200, 0.5): 10 sd either side
    # The split is the routing policy's: the same session lands on the same side in every gateway.
    assert all(version == (1 if canary_bucket(TENANT, s) < 0.5 else 0) for s, version, _ in first)

    second = [stack.served(s) for s, _, _ in first]
    assert [v for _, v, _ in second] == [v for _, v, _ in first]
    stack.check_captured(first + second)


def test_an_admin_pin_routes_the_tenants_new_sessions(stack):
    old, version, _ = stack.served()
    assert version == 0
    stack.publish("stable")
    stack.wait_fleet(stable=1, canary=None, held={0, 1})

    r = stack.http.put(f"{stack.gateway}/admin/pins/{TENANT}", json={"version": 0})
    assert r.status_code == 200 and r.json() == {"tenant": TENANT, "version": 0, "served": True}
    assert stack.http.get(f"{stack.gateway}/admin/pins").json() == {"pins": {TENANT: 0}}
    pinned = [stack.served() for _ in range(5)]  # effective at once: the PUT refreshes the router
    assert [v for _, v, _ in pinned] == [0] * 5
    # Another tenant's pin does not touch this tenant.
    assert stack.http.put(f"{stack.gateway}/admin/pins/acme", json={"version": 1}).status_code == 200
    assert stack.http.get(f"{stack.gateway}/admin/pins").json() == {"pins": {TENANT: 0, "acme": 1}}
    pinned.append(stack.served())
    assert pinned[-1][1] == 0
    assert stack.http.put(f"{stack.gateway}/admin/pins/acme", json={"version": None}).status_code == 200

    for bad in ({"version": -1}, {"version": "1"}, {"v": 1}):
        r = stack.http.put(f"{stack.gateway}/admin/pins/{TENANT}", json=bad)
        assert r.status_code == 400, (bad, r.text)
    r = stack.http.put(f"{stack.gateway}/admin/pins/{TENANT}", json={"version": 999})
    assert r.status_code == 404 and r.json()["error"]["code"] == "version_not_found", r.text
    assert stack.http.get(f"{stack.gateway}/admin/pins").json() == {"pins": {TENANT: 0}}

    r = stack.http.put(f"{stack.gateway}/admin/pins/{TENANT}", json={"version": None})
    assert r.status_code == 200 and r.json() == {"tenant": TENANT, "version": None, "served": True}
    assert stack.http.get(f"{stack.gateway}/admin/pins").json() == {"pins": {}}
    unpinned = [stack.served() for _ in range(5)]
    assert [v for _, v, _ in unpinned] == [1] * 5
    # A pin chooses new sessions' version only: pinned sessions stay put once it is gone.
    assert [stack.served(s)[1] for s, _, _ in pinned] == [0] * 6
    assert stack.served(old)[1] == 0
    stack.check_captured(pinned + unpinned)


def test_admin_version_routes_promote_and_roll_back_and_the_fleet_follows(stack):
    url = f"{stack.gateway}/admin/versions"
    v1 = stack.publish("candidate")
    r = stack.http.post(f"{url}/{v1}/promote")
    assert r.status_code == 200 and r.json() == {"changed": [{"version": v1, "status": "stable"}]}, r.text
    stack.wait_fleet(stable=v1, canary=None, held={0, v1})
    assert stack.served()[1] == v1
    listed = {v["version"]: v["status"] for v in stack.http.get(url).json()["versions"]}
    assert listed == {0: "retired", v1: "stable"}

    r = stack.http.post(f"{url}/{v1}/rollback")  # the stable one: v0 comes back first
    assert r.status_code == 200 and r.json() == {"changed": [{"version": 0, "status": "stable"},
                                                             {"version": v1, "status": "rolled_back"}]}, r.text
    stack.wait_fleet(stable=0, canary=None, held={0, v1})
    assert stack.served()[1] == 0
    assert [t["reason"] for t in stack.registry.transitions(v1)][-1].startswith("manual rollback")

    r = stack.http.post(f"{url}/0/rollback")  # nothing earlier to restore
    assert r.status_code == 409 and r.json()["error"]["code"] == "rollout_conflict", r.text
    assert stack.http.post(f"{url}/999/promote").status_code == 404
    assert stack.http.post(f"{url}/0/explode").status_code == 404
    assert stack.registry.latest("stable").version == 0


def test_pinning_the_line_ends_the_canary_for_new_sessions_and_freezes_the_controller(stack):
    from serving.rollout import step

    url = f"{stack.gateway}/admin/versions"
    v1 = stack.publish("canary")
    stack.wait_fleet(stable=0, canary=v1, held={0, v1})
    canary_side = [f"pin-{i}" for i in range(200) if canary_bucket(TENANT, f"pin-{i}") < 0.5]
    assert stack.served(canary_side[0])[1] == v1  # the canary gets its share before the pin

    r = stack.http.post(f"{url}/0/pin", json={"reason": "incident 42"})
    assert r.status_code == 200, r.text
    assert r.json()["changed"] == [{"version": v1, "status": "candidate"}]
    assert (r.json()["pin"]["version"], r.json()["pin"]["reason"]) == (0, "incident 42")
    wait_until("the router to drop the canary", lambda: stack.live_versions()["canary"] is None, timeout_s=20)
    pinned = [stack.served(s) for s in canary_side[1:9]]  # new sessions that the canary would have had
    assert [v for _, v, _ in pinned] == [0] * 8

    # The controller, ticking on the registry, changes nothing while pinned; manual moves are refused.
    decision = step(stack.registry, stack.registry.sessions, stack.settings.rollout)
    assert (decision.action, decision.version) == ("pinned", 0) and "incident 42" in decision.reason
    r = stack.http.post(f"{url}/{v1}/promote", json={"reason": "ship"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "line_pinned", r.text
    assert "pinned to v0 by admin API (loopback" in r.json()["error"]["message"]
    listed = stack.http.get(url).json()
    assert listed["pin"]["version"] == 0 and listed["next_decision"]["action"] == "pinned"
    assert {v["version"]: v["status"] for v in listed["versions"]} == {0: "stable", v1: "candidate"}

    r = stack.http.post(f"{stack.gateway}/admin/unpin", json={"reason": "resolved"})
    assert r.status_code == 200 and r.json()["unpinned"]["version"] == 0, r.text
    assert stack.http.post(f"{stack.gateway}/admin/unpin").status_code == 409  # nothing left to lift
    assert step(stack.registry, stack.registry.sessions, stack.settings.rollout).action == "canary"
    stack.wait_fleet(stable=0, canary=v1, held={0, v1})
    resumed = stack.served(canary_side[9])
    assert resumed[1] == v1
    stack.check_captured(pinned + [resumed])


def test_the_openai_sdk_lists_the_model_with_its_live_versions(stack):
    stack.publish("canary")
    stack.wait_fleet(stable=0, canary=1, held={0, 1})
    with openai.OpenAI(base_url=f"{stack.gateway}/v1", api_key="unused", max_retries=0, timeout=30) as client:
        (model,) = client.models.list().data
    assert (model.id, model.object, model.owned_by) == (stack.settings.model.line, "model", "flywheel")
    live = model.model_extra["flywheel"]
    assert (live["model_line"], live["stable"], live["canary"], live["canary_fraction"]) == (
        stack.settings.model.line, 0, 1, 0.5)
    assert live["versions"] == [{"version": 0, "nodes": [NODE_ID]}, {"version": 1, "nodes": [NODE_ID]}]
    (node,) = live["nodes"]
    assert (node["node_id"], node["live_version"], node["versions"]) == (NODE_ID, 0, [0, 1])
    node_view = stack.http.get(f"{stack.node}/health").json()
    assert (node_view["version"], node_view["versions"]) == (0, [0, 1])  # what the gateway shows is what the node holds
    assert "127.0.0.1" not in json.dumps(live)  # node addresses stay inside
