"""The gateway's shared, expiring state: rate limits, sticky sessions, owners, feedback claims, pins, console logins.

Two backends behind one async interface (:class:`GatewayState`), chosen by ``settings.live.kind``:
``memory`` (one gateway process, the embedded default) and ``redis`` (``redis.asyncio``, shared by
every gateway; all keys under ``settings.live.key_prefix`` + ``gw:``).

Invariants:
- Sessions are scoped by tenant in every key (the tenant is length-prefixed, so no choice of
  tenant and session id can make two tenants' keys meet): two tenants using the same session id
  never share a session, its version pin or its ownership.
- :meth:`GatewayState.pin_session` is atomic (one Lua script in Redis; no ``await`` inside an
  operation of the memory backend): of any number of concurrent callers for one session, exactly
  one version wins and every caller gets it back. A pin stored as "unknown" (``version=None``: the
  routing table had no version yet) is replaced by the first concrete version offered; a concrete
  version is replaced only by :meth:`GatewayState.set_session_version` (a forced repin). Every
  ``pin_session`` refreshes the session's TTL; reads do not.
- :meth:`GatewayState.admit` is a token bucket per key: capacity ``burst`` (0: ``ceil(rpm / 6)``),
  refilled at ``rpm / 60`` tokens per second, one token per request; ``rpm == 0`` is unlimited and
  costs no round trip. In Redis the bucket is read, refilled and spent in one Lua script on the
  Redis server's clock, so gateways on several hosts share one limit without clock skew.
- Entries expire after the TTL they were written with. The memory backend also holds at most
  ``max_entries`` per map, dropping the least recently written first: an evicted session is pinned
  afresh on its next request, and an evicted generation owner is found in the database by
  :class:`serving.gateway.auth.Ownership`.
- A feedback id is claimed once per tenant (:meth:`GatewayState.claim_feedback`): the first
  submission's content is kept for the ownership TTL, so a replay can be compared with it.
- A console login (:meth:`GatewayState.put_console`) is stored under the SHA-256 of its cookie's
  token, never the token itself, and expires with the TTL it was written with.
- Backend failures surface as :class:`StateUnavailable` (never a silent default).
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from flywheel.settings import Settings


class StateUnavailable(RuntimeError):
    """The live-state backend (Redis) could not be reached or answered with an error."""


class GatewayState(Protocol):
    async def admit(self, key_id: str, rpm: int, burst: int) -> float | None:
        """None if the request may go ahead; else the seconds until it may be retried."""
        ...

    async def pin_session(self, tenant: str, session_id: str, version: int | None, ttl_s: float) -> int | None:
        """Pin the session to ``version`` unless it holds one; the version it holds now (None: unknown)."""
        ...

    async def set_session_version(self, tenant: str, session_id: str, version: int, ttl_s: float) -> None: ...

    async def session_version(self, tenant: str, session_id: str) -> int | None: ...

    async def session_exists(self, tenant: str, session_id: str) -> bool: ...

    async def record_generation(self, generation_id: str, tenant: str, session_id: str, ttl_s: float) -> None: ...

    async def generation_owner(self, generation_id: str) -> tuple[str, str] | None:
        """``(tenant, session_id)`` of a recorded generation, while its entry lives."""
        ...

    async def claim_feedback(self, tenant: str, feedback_id: str, content: str, ttl_s: float) -> str | None:
        """Record ``content`` (the canonical JSON of what the client submitted) as ``tenant``'s
        ``feedback_id`` unless one is recorded; None when this call recorded it, else the content
        recorded first. Atomic: of concurrent claims exactly one gets None."""
        ...

    async def release_feedback(self, tenant: str, feedback_id: str, content: str) -> None:
        """Forget the claim, if it still holds ``content`` (the submission failed: a retry may differ)."""
        ...

    async def get_pins(self) -> dict[str, int]:
        """Admin-set per-tenant version pins."""
        ...

    async def set_pin(self, tenant: str, version: int | None) -> None:
        """Pin ``tenant``'s new sessions to ``version``; None removes the pin."""
        ...

    async def put_console(self, token_sha: str, record: str, ttl_s: float) -> None:
        """Store a console login (its record, JSON) under the SHA-256 of its token."""
        ...

    async def console(self, token_sha: str) -> str | None:
        """The record of a live console login; None once it expired or was dropped."""
        ...

    async def drop_console(self, token_sha: str) -> None: ...

    async def close(self) -> None: ...


def make_state(settings: Settings) -> GatewayState:
    """The backend named by ``settings.live.kind``."""
    if settings.live.kind == "redis":
        return RedisState(settings.live.redis_url, settings.live.key_prefix)
    return MemoryState()


# Pure parts ------------------------------------------------------------------------------------


def bucket_capacity(rpm: int, burst: int) -> int:
    return burst if burst > 0 else max(1, math.ceil(rpm / 6))


def take_token(tokens: float | None, last_s: float, now_s: float, rpm: int, burst: int) -> tuple[float, float | None]:
    """One request against a bucket holding ``tokens`` at ``last_s`` (None: a new, full bucket).

    Returns the tokens left at ``now_s`` and None (admitted) or the seconds until one token is there.
    """
    capacity = bucket_capacity(rpm, burst)
    rate = rpm / 60.0
    tokens = float(capacity) if tokens is None else min(float(capacity), tokens + max(0.0, now_s - last_s) * rate)
    if tokens >= 1.0:
        return tokens - 1.0, None
    return tokens, (1.0 - tokens) / rate


def session_key(tenant: str, session_id: str) -> str:
    """The tenant-scoped name of a session (length-prefixed: unambiguous for any strings)."""
    return f"s:{len(tenant)}:{tenant}:{session_id}"


def feedback_key(tenant: str, feedback_id: str) -> str:
    """The tenant-scoped name of a feedback id's claim (length-prefixed like :func:`session_key`)."""
    return f"f:{len(tenant)}:{tenant}:{feedback_id}"


def _check_ttl(ttl_s: float) -> int:
    if not ttl_s > 0:
        raise ValueError(f"ttl_s must be positive, got {ttl_s!r}")
    return max(1, int(round(ttl_s * 1000)))


def _version(value: str | None) -> int | None:
    return int(value) if value else None


# Memory ----------------------------------------------------------------------------------------


class _TTLMap:
    """A bounded map whose entries expire; the least recently written goes first when full."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._items: OrderedDict[str, tuple[Any, float]] = OrderedDict()

    def get(self, key: str, now: float) -> Any:
        entry = self._items.get(key)
        if entry is None:
            return None
        if entry[1] <= now:
            del self._items[key]
            return None
        return entry[0]

    def put(self, key: str, value: Any, expires: float) -> None:
        self._items[key] = (value, expires)
        self._items.move_to_end(key)
        while len(self._items) > self.max_entries:
            self._items.popitem(last=False)

    def pop(self, key: str) -> None:
        self._items.pop(key, None)

    def touch(self, key: str, expires: float) -> None:
        entry = self._items.get(key)
        if entry is not None:
            self.put(key, entry[0], expires)


class MemoryState:
    """In-process state for one gateway on one event loop (each operation runs without yielding)."""

    def __init__(self, max_entries: int = 1_000_000) -> None:
        self._buckets = _TTLMap(max_entries)
        self._sessions = _TTLMap(max_entries)
        self._generations = _TTLMap(max_entries)
        self._feedback = _TTLMap(max_entries)
        self._consoles = _TTLMap(10_000)
        self._pins: dict[str, int] = {}

    async def admit(self, key_id: str, rpm: int, burst: int) -> float | None:
        if rpm <= 0:
            return None
        now = time.monotonic()
        tokens, last = self._buckets.get(key_id, now) or (None, now)
        tokens, retry = take_token(tokens, last, now, rpm, burst)
        # Idle for a full refill, a bucket is full again: it may be forgotten.
        self._buckets.put(key_id, (tokens, now), now + bucket_capacity(rpm, burst) * 60.0 / rpm + 1.0)
        return retry

    async def pin_session(self, tenant: str, session_id: str, version: int | None, ttl_s: float) -> int | None:
        ttl_ms, now = _check_ttl(ttl_s), time.monotonic()
        key = session_key(tenant, session_id)
        current = self._sessions.get(key, now)
        if current is None or (current == "" and version is not None):
            current = "" if version is None else str(int(version))
        self._sessions.put(key, current, now + ttl_ms / 1000)
        return _version(current)

    async def set_session_version(self, tenant: str, session_id: str, version: int, ttl_s: float) -> None:
        self._sessions.put(session_key(tenant, session_id), str(int(version)), time.monotonic() + _check_ttl(ttl_s) / 1000)

    async def session_version(self, tenant: str, session_id: str) -> int | None:
        return _version(self._sessions.get(session_key(tenant, session_id), time.monotonic()))

    async def session_exists(self, tenant: str, session_id: str) -> bool:
        return self._sessions.get(session_key(tenant, session_id), time.monotonic()) is not None

    async def record_generation(self, generation_id: str, tenant: str, session_id: str, ttl_s: float) -> None:
        self._generations.put(generation_id, (tenant, session_id), time.monotonic() + _check_ttl(ttl_s) / 1000)

    async def generation_owner(self, generation_id: str) -> tuple[str, str] | None:
        return self._generations.get(generation_id, time.monotonic())

    async def claim_feedback(self, tenant: str, feedback_id: str, content: str, ttl_s: float) -> str | None:
        key, now = feedback_key(tenant, feedback_id), time.monotonic()
        held = self._feedback.get(key, now)
        if held is None:
            self._feedback.put(key, content, now + _check_ttl(ttl_s) / 1000)
        return held

    async def release_feedback(self, tenant: str, feedback_id: str, content: str) -> None:
        key = feedback_key(tenant, feedback_id)
        if self._feedback.get(key, time.monotonic()) == content:
            self._feedback.pop(key)

    async def get_pins(self) -> dict[str, int]:
        return dict(self._pins)

    async def set_pin(self, tenant: str, version: int | None) -> None:
        if version is None:
            self._pins.pop(tenant, None)
        else:
            self._pins[tenant] = int(version)

    async def put_console(self, token_sha: str, record: str, ttl_s: float) -> None:
        self._consoles.put(token_sha, record, time.monotonic() + _check_ttl(ttl_s) / 1000)

    async def console(self, token_sha: str) -> str | None:
        return self._consoles.get(token_sha, time.monotonic())

    async def drop_console(self, token_sha: str) -> None:
        self._consoles.pop(token_sha)

    async def close(self) -> None:
        pass


# Redis -----------------------------------------------------------------------------------------

# KEYS[1] bucket hash {tokens, ts}; ARGV rpm, capacity. Returns 0 (admitted) or ms until a token.
# Mirrors take_token() on the server's clock (ms).
_ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local rate = tonumber(ARGV[1]) / 60000
local cap = tonumber(ARGV[2])
local v = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(v[1])
if tokens == nil then
  tokens = cap
else
  tokens = math.min(cap, tokens + math.max(0, now - tonumber(v[2])) * rate)
end
local retry = 0
if tokens >= 1 then
  tokens = tokens - 1
else
  retry = math.max(1, math.ceil((1 - tokens) / rate))
end
redis.call('HSET', KEYS[1], 'tokens', string.format('%.17g', tokens), 'ts', string.format('%.17g', now))
redis.call('PEXPIRE', KEYS[1], math.ceil(cap / rate) + 1000)
return retry
"""

# KEYS[1] session; ARGV[1] version or "" (unknown), ARGV[2] ttl ms. Returns the version held now.
_PIN = """
local cur = redis.call('GET', KEYS[1])
if (not cur) or (cur == '' and ARGV[1] ~= '') then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return ARGV[1]
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return cur
"""

# KEYS[1] feedback claim; ARGV[1] content. Deletes the claim only if it still holds that content.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

T = TypeVar("T")


def _guard(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    @functools.wraps(method)
    async def wrapper(self: RedisState, *args: Any, **kwargs: Any) -> T:
        import redis

        try:
            return await method(self, *args, **kwargs)
        except redis.RedisError as exc:
            raise StateUnavailable(f"gateway state in Redis failed: {type(exc).__name__}: {exc}") from exc

    return wrapper


class RedisState:
    """Gateway state in Redis via ``redis.asyncio``; connections open lazily on the running loop."""

    def __init__(self, url: str, prefix: str, *, socket_timeout_s: float = 2.0) -> None:
        import redis.asyncio

        self.prefix = f"{prefix}gw:"
        self._redis = redis.asyncio.Redis.from_url(
            url, decode_responses=True, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s
        )
        self._admit = self._redis.register_script(_ADMIT)
        self._pin = self._redis.register_script(_PIN)
        self._release = self._redis.register_script(_RELEASE)
        self._pins_key = f"{self.prefix}pins"

    def _session(self, tenant: str, session_id: str) -> str:
        return self.prefix + session_key(tenant, session_id)

    @_guard
    async def admit(self, key_id: str, rpm: int, burst: int) -> float | None:
        if rpm <= 0:
            return None
        retry_ms = await self._admit(keys=[f"{self.prefix}rl:{key_id}"], args=[rpm, bucket_capacity(rpm, burst)])
        return None if int(retry_ms) == 0 else int(retry_ms) / 1000.0

    @_guard
    async def pin_session(self, tenant: str, session_id: str, version: int | None, ttl_s: float) -> int | None:
        value = "" if version is None else str(int(version))
        return _version(await self._pin(keys=[self._session(tenant, session_id)], args=[value, _check_ttl(ttl_s)]))

    @_guard
    async def set_session_version(self, tenant: str, session_id: str, version: int, ttl_s: float) -> None:
        await self._redis.set(self._session(tenant, session_id), str(int(version)), px=_check_ttl(ttl_s))

    @_guard
    async def session_version(self, tenant: str, session_id: str) -> int | None:
        return _version(await self._redis.get(self._session(tenant, session_id)))

    @_guard
    async def session_exists(self, tenant: str, session_id: str) -> bool:
        return bool(await self._redis.exists(self._session(tenant, session_id)))

    @_guard
    async def record_generation(self, generation_id: str, tenant: str, session_id: str, ttl_s: float) -> None:
        value = json.dumps([tenant, session_id], separators=(",", ":"))
        await self._redis.set(f"{self.prefix}g:{generation_id}", value, px=_check_ttl(ttl_s))

    @_guard
    async def generation_owner(self, generation_id: str) -> tuple[str, str] | None:
        value = await self._redis.get(f"{self.prefix}g:{generation_id}")
        if value is None:
            return None
        tenant, session_id = json.loads(value)
        return tenant, session_id

    @_guard
    async def claim_feedback(self, tenant: str, feedback_id: str, content: str, ttl_s: float) -> str | None:
        # SET NX GET (Redis >= 7.0): sets only when absent and returns what was there, in one step.
        return await self._redis.set(self.prefix + feedback_key(tenant, feedback_id), content,
                                     nx=True, get=True, px=_check_ttl(ttl_s))

    @_guard
    async def release_feedback(self, tenant: str, feedback_id: str, content: str) -> None:
        await self._release(keys=[self.prefix + feedback_key(tenant, feedback_id)], args=[content])

    @_guard
    async def get_pins(self) -> dict[str, int]:
        return {tenant: int(v) for tenant, v in (await self._redis.hgetall(self._pins_key)).items()}

    @_guard
    async def set_pin(self, tenant: str, version: int | None) -> None:
        if version is None:
            await self._redis.hdel(self._pins_key, tenant)
        else:
            await self._redis.hset(self._pins_key, tenant, str(int(version)))

    @_guard
    async def put_console(self, token_sha: str, record: str, ttl_s: float) -> None:
        await self._redis.set(f"{self.prefix}c:{token_sha}", record, px=_check_ttl(ttl_s))

    @_guard
    async def console(self, token_sha: str) -> str | None:
        return await self._redis.get(f"{self.prefix}c:{token_sha}")

    @_guard
    async def drop_console(self, token_sha: str) -> None:
        await self._redis.delete(f"{self.prefix}c:{token_sha}")

    async def close(self) -> None:
        await self._redis.aclose()
