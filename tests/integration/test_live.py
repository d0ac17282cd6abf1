"""flywheel.live: the in-process backend and real Redis, held to the same contract."""

from __future__ import annotations

import threading
import time
import uuid

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


def _key() -> str:
    return f"k-{uuid.uuid4().hex}"


def test_get_set_delete(live):
    key, value = _key(), f"v-{uuid.uuid4().hex} ünïcode"
    assert live.get(key) is None
    live.set(key, value)
    assert live.get(key) == value
    live.set(key, "second")
    assert live.get(key) == "second"
    live.delete(key)
    assert live.get(key) is None
    live.delete(key)  # deleting a missing key is fine
    assert live.get(key) is None


def test_ttl_is_honoured(live):
    short, forever = _key(), _key()
    live.set(short, "a", ttl_s=0.2)
    live.set(forever, "b")
    assert live.get(short) == "a"
    time.sleep(0.35)
    assert live.get(short) is None
    assert live.get(forever) == "b"
    # Setting again without a ttl makes a key permanent.
    live.set(short, "c", ttl_s=0.2)
    live.set(short, "d")
    time.sleep(0.35)
    assert live.get(short) == "d"


def test_set_if_absent_returns_the_stored_value(live):
    key = _key()
    assert live.set_if_absent(key, "first") == "first"
    assert live.set_if_absent(key, "second") == "first"
    assert live.get(key) == "first"
    live.delete(key)
    assert live.set_if_absent(key, "third", ttl_s=0.2) == "third"
    assert live.set_if_absent(key, "fourth", ttl_s=0.2) == "third"
    time.sleep(0.35)
    assert live.get(key) is None
    assert live.set_if_absent(key, "fifth") == "fifth"


def test_set_if_absent_has_one_winner_under_contention(live):
    key, threads = _key(), 12
    barrier = threading.Barrier(threads)
    results: list[str] = [""] * threads

    def claim(i: int) -> None:
        barrier.wait(timeout=10)
        results[i] = live.set_if_absent(key, f"node-{i}", ttl_s=30)

    workers = [threading.Thread(target=claim, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=30)
    assert len(set(results)) == 1
    assert results[0] in {f"node-{i}" for i in range(threads)}
    assert live.get(key) == results[0]


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
        live.set(_key(), "v", ttl_s=ttl)
    with pytest.raises(ValueError):
        live.set_if_absent(_key(), "v", ttl_s=ttl)
    with pytest.raises(ValueError):
        live.heartbeat("n", {}, ttl_s=ttl)


def test_redis_prefixes_are_isolated(redis_url, live_prefix):
    one = RedisLive(redis_url, f"{live_prefix}one:")
    two = RedisLive(redis_url, f"{live_prefix}two:")
    try:
        one.set("shared-name", "from-one")
        one.heartbeat("node-1", {"v": 1}, ttl_s=30)
        assert two.get("shared-name") is None
        assert two.heartbeats() == {}
        assert two.set_if_absent("shared-name", "from-two") == "from-two"
        assert one.get("shared-name") == "from-one"
    finally:
        one.close()
        two.close()


def test_redis_state_is_shared_between_clients(redis_url, live_prefix):
    writer, reader = RedisLive(redis_url, live_prefix), RedisLive(redis_url, live_prefix)
    try:
        writer.set("route:s1", "node-7", ttl_s=30)
        writer.heartbeat("node-7", {"version": 9}, ttl_s=30)
        assert reader.get("route:s1") == "node-7"
        assert reader.set_if_absent("route:s1", "node-8") == "node-7"
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
        redis_backed.set("k", "v")
        assert direct.get("k") == "v"
    finally:
        redis_backed.close()
        direct.close()
