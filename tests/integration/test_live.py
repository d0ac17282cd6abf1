"""flywheel.live: the in-process backend and real Redis, held to the same contract (heartbeats, notices)."""

from __future__ import annotations

import time

import pytest

from flywheel.live import MemoryLive, RedisLive, make_live
from flywheel.settings import load_settings

pytestmark = pytest.mark.integration


@pytest.fixture(params=["memory", "redis"])
def live(request: pytest.FixtureRequest):
    if request.param == "memory":
        backend = MemoryLive()
        yield backend
        backend.close()
    else:
        yield request.getfixturevalue("redis_live")


def test_heartbeats_only_live_nodes(live):
    assert live.heartbeats() == {}
    live.heartbeat("node-a", {"version": 3, "url": "http://a", "nested": {"ok": True}}, ttl_s=30)
    live.heartbeat("node-b", {"version": 2}, ttl_s=0.2)
    assert live.heartbeats() == {
        "node-a": {"version": 3, "url": "http://a", "nested": {"ok": True}},
        "node-b": {"version": 2},
    }
    time.sleep(0.35)
    assert live.heartbeats() == {"node-a": {"version": 3, "url": "http://a", "nested": {"ok": True}}}
    # A node that comes back, and a node whose payload changes.
    live.heartbeat("node-b", {"version": 4}, ttl_s=30)
    live.heartbeat("node-a", {"version": 5}, ttl_s=30)
    assert live.heartbeats() == {"node-a": {"version": 5}, "node-b": {"version": 4}}


def test_heartbeat_payload_is_a_snapshot(live):
    payload = {"version": 1}
    live.heartbeat("node-x", payload, ttl_s=30)
    payload["version"] = 2
    seen = live.heartbeats()
    seen["node-x"]["version"] = 3
    assert live.heartbeats() == {"node-x": {"version": 1}}


@pytest.mark.parametrize("ttl", [0, -1.0])
def test_bad_ttl_is_rejected(live, ttl):
    with pytest.raises(ValueError):
        live.heartbeat("n", {}, ttl_s=ttl)


def test_redis_prefixes_are_isolated(redis_url, live_prefix):
    one = RedisLive(redis_url, f"{live_prefix}one:")
    two = RedisLive(redis_url, f"{live_prefix}two:")
    try:
        one.heartbeat("node-1", {"v": 1}, ttl_s=30)
        assert two.heartbeats() == {}
        two.heartbeat("node-1", {"v": 2}, ttl_s=30)
        assert one.heartbeats() == {"node-1": {"v": 1}}
    finally:
        one.close()
        two.close()


def test_redis_state_is_shared_between_clients(redis_url, live_prefix):
    writer, reader = RedisLive(redis_url, live_prefix), RedisLive(redis_url, live_prefix)
    try:
        writer.heartbeat("node-7", {"version": 9}, ttl_s=30)
        assert reader.heartbeats() == {"node-7": {"version": 9}}
    finally:
        writer.close()
        reader.close()


def test_make_live_follows_settings(redis_url, live_prefix):
    memory = make_live(load_settings())
    assert isinstance(memory, MemoryLive)
    settings = load_settings(live={"kind": "redis", "redis_url": redis_url, "key_prefix": live_prefix})
    redis_backed, direct = make_live(settings), RedisLive(redis_url, live_prefix)
    try:
        assert isinstance(redis_backed, RedisLive)
        redis_backed.heartbeat("node-k", {"v": 1}, ttl_s=30)
        assert direct.heartbeats() == {"node-k": {"v": 1}}
    finally:
        redis_backed.close()
        direct.close()
