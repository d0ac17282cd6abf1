"""Live state: small, expiring, shared facts: node heartbeats and version notices.

Two backends behind one interface, chosen by ``settings.live.kind``: ``memory`` (one process,
the embedded default) and ``redis`` (shared by every process and host).

Invariants:
- Heartbeat payloads are JSON objects, snapshotted when sent and when read.
- ``heartbeats()`` returns only nodes whose last heartbeat (sent with ``ttl_s``) has not yet
  expired.
- Redis keys all start with ``settings.live.key_prefix``; nothing outside the prefix is touched.
- Notifications (``notify`` / ``listen``) are wake-ups, not messages: best effort, no payload, no
  replay. A listener that misses one (Redis down, not yet subscribed) still polls the source of
  truth on its own schedule; a notification only makes it look sooner.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from flywheel.settings import Settings


class LiveState(Protocol):
    def heartbeat(self, node_id: str, payload: dict[str, Any], ttl_s: float) -> None: ...

    def heartbeats(self) -> dict[str, dict[str, Any]]: ...

    def notify(self, channel: str) -> None:
        """Wake every listener of ``channel``."""

    def listen(self, channel: str, wake: threading.Event) -> Callable[[], None]:
        """Set ``wake`` whenever ``channel`` is notified, until the returned function is called."""
        ...

    def close(self) -> None: ...


def make_live(settings: Settings) -> LiveState:
    """The live-state backend named by ``settings.live.kind``."""
    if settings.live.kind == "redis":
        return RedisLive(settings.live.redis_url, settings.live.key_prefix)
    return MemoryLive()


def _check_ttl(ttl_s: float) -> None:
    if not ttl_s > 0:
        raise ValueError(f"ttl_s must be positive, got {ttl_s!r}")


class MemoryLive:
    """In-process live state; thread-safe. Expired heartbeats are dropped when next read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._listeners: dict[str, list[threading.Event]] = {}
        self._beats: dict[str, tuple[dict[str, Any], float]] = {}

    def heartbeat(self, node_id: str, payload: dict[str, Any], ttl_s: float) -> None:
        _check_ttl(ttl_s)
        # Round-trip through JSON: same contract as Redis (JSON objects only, no shared mutable state).
        snapshot = json.loads(json.dumps(payload))
        with self._lock:
            self._beats[node_id] = (snapshot, time.monotonic() + ttl_s)

    def heartbeats(self) -> dict[str, dict[str, Any]]:
        now = time.monotonic()
        with self._lock:
            for node_id in [n for n, (_, expires) in self._beats.items() if expires <= now]:
                del self._beats[node_id]
            return {node_id: json.loads(json.dumps(payload)) for node_id, (payload, _) in self._beats.items()}

    def notify(self, channel: str) -> None:
        with self._lock:
            listeners = list(self._listeners.get(channel, ()))
        for wake in listeners:
            wake.set()

    def listen(self, channel: str, wake: threading.Event) -> Callable[[], None]:
        with self._lock:
            self._listeners.setdefault(channel, []).append(wake)

        def stop() -> None:
            with self._lock:
                if wake in self._listeners.get(channel, []):
                    self._listeners[channel].remove(wake)

        return stop

    def close(self) -> None:
        pass


# Heartbeats: KEYS[1] a sorted set node -> expiry (ms, Redis server clock), KEYS[2] a hash node -> payload.
_HEARTBEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return now
"""

_HEARTBEATS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local dead = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
for i, node in ipairs(dead) do
  redis.call('HDEL', KEYS[2], node)
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local out = {}
local alive = redis.call('ZRANGE', KEYS[1], 0, -1)
for i, node in ipairs(alive) do
  out[#out + 1] = node
  out[#out + 1] = redis.call('HGET', KEYS[2], node) or '{}'
end
return out
"""


def _ttl_ms(ttl_s: float) -> int:
    return max(1, int(round(ttl_s * 1000)))


class RedisLive:
    """Live state in Redis, every key under ``prefix``; safe to share between threads."""

    def __init__(self, url: str, prefix: str, *, socket_timeout_s: float = 5.0) -> None:
        import redis

        self.prefix = prefix
        self._redis = redis.Redis.from_url(
            url, decode_responses=True, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s
        )
        self._heartbeat = self._redis.register_script(_HEARTBEAT)
        self._heartbeats = self._redis.register_script(_HEARTBEATS)
        self._beat_keys = [f"{prefix}heartbeats:expiry", f"{prefix}heartbeats:payload"]

    def heartbeat(self, node_id: str, payload: dict[str, Any], ttl_s: float) -> None:
        _check_ttl(ttl_s)
        self._heartbeat(keys=self._beat_keys, args=[node_id, json.dumps(payload), _ttl_ms(ttl_s)])

    def heartbeats(self) -> dict[str, dict[str, Any]]:
        flat = self._heartbeats(keys=self._beat_keys)
        return {flat[i]: json.loads(flat[i + 1]) for i in range(0, len(flat), 2)}

    def notify(self, channel: str) -> None:
        self._redis.publish(f"{self.prefix}channel:{channel}", "1")

    def listen(self, channel: str, wake: threading.Event) -> Callable[[], None]:
        """A daemon thread subscribed to the channel (re-subscribing after connection errors)."""
        import redis

        done = threading.Event()
        name = f"{self.prefix}channel:{channel}"

        def run() -> None:
            while not done.is_set():
                pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
                try:
                    pubsub.subscribe(name)
                    while not done.is_set():
                        if pubsub.get_message(timeout=1.0) is not None:
                            wake.set()
                except (redis.ConnectionError, redis.TimeoutError, OSError):
                    done.wait(1.0)  # Redis away: the listener's own polling carries on meanwhile
                finally:
                    pubsub.close()

        thread = threading.Thread(target=run, name=f"listen-{channel}", daemon=True)
        thread.start()

        def stop() -> None:
            done.set()
            thread.join(timeout=5.0)

        return stop

    def close(self) -> None:
        self._redis.close()
