"""serving.gateway.state on both backends (in-process and real Redis) held to one contract, and
Ownership with its database fallback on SQLite + memory and PostgreSQL + Redis."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import pytest

from flywheel.db.models import Generation, SessionState
from flywheel.db.session import make_engine, make_session_factory
from serving.errors import APIError
from serving.gateway.auth import Ownership
from serving.gateway.state import MemoryState, RedisState, StateUnavailable
from testbed.procs import free_port

pytestmark = pytest.mark.integration


@pytest.fixture(params=["memory", "redis"])
def make_state(request: pytest.FixtureRequest) -> Callable[[], Any]:
    if request.param == "memory":
        return MemoryState
    url, prefix = request.getfixturevalue("redis_url"), request.getfixturevalue("live_prefix")
    return lambda: RedisState(url, prefix)


def run(make_state: Callable[[], Any], body: Callable[[Any], Awaitable[Any]]) -> Any:
    """``body(state)`` on a fresh event loop (redis.asyncio connections belong to one loop)."""

    async def main() -> Any:
        state = make_state()
        try:
            return await body(state)
        finally:
            await state.close()

    return asyncio.run(main())


def _id() -> str:
    return uuid.uuid4().hex


def test_rate_limit_allows_the_burst_then_429_then_refills(make_state):
    key, other = _id(), _id()

    async def body(state) -> None:
        assert [await state.admit(key, 60, 3) for _ in range(3)] == [None, None, None]
        retry = await state.admit(key, 60, 3)
        assert retry is not None and 0 < retry <= 1.0
        assert await state.admit(other, 60, 3) is None  # buckets are per key
        await asyncio.sleep(retry + 0.05)
        assert await state.admit(key, 60, 3) is None
        again = await state.admit(key, 60, 3)
        assert again is not None and again > 0.5

    run(make_state, body)


def test_default_burst_and_unlimited(make_state):
    key, free = _id(), _id()

    async def body(state) -> None:
        # Capacity 60 / 6 = 10, one token back a second: the 11 calls must take under a second (at
        # 600 a minute, 101 calls had 0.1 s, and a loaded machine's round trips refilled one).
        results = [await state.admit(key, 60, 0) for _ in range(11)]
        assert results[:10] == [None] * 10 and results[10] is not None and 0 < results[10] <= 1.0
        assert all([await state.admit(free, 0, 0) is None for _ in range(500)])

    run(make_state, body)


def test_rate_limit_is_atomic_under_concurrency(make_state):
    key = _id()

    async def body(state) -> list:
        return await asyncio.gather(*[state.admit(key, 6, 10) for _ in range(60)])

    results = run(make_state, body)
    assert sum(r is None for r in results) == 10


def test_redis_buckets_are_shared_by_gateways(redis_url, live_prefix):
    key = _id()

    async def body() -> list:
        gateways = [RedisState(redis_url, live_prefix) for _ in range(3)]
        try:
            return await asyncio.gather(*[gateways[i % 3].admit(key, 6, 9) for i in range(30)])
        finally:
            for g in gateways:
                await g.close()

    assert sum(r is None for r in asyncio.run(body())) == 9


def test_concurrent_pins_have_one_winner(make_state):
    session = _id()

    async def body(state) -> tuple[list, Any]:
        results = await asyncio.gather(*[state.pin_session("acme", session, v, 60) for v in range(100)])
        return results, await state.session_version("acme", session)

    results, stored = run(make_state, body)
    assert len(set(results)) == 1 and results[0] in range(100) and stored == results[0]


def test_redis_pin_has_one_winner_across_gateways(redis_url, live_prefix):
    session = _id()

    async def body() -> list:
        gateways = [RedisState(redis_url, live_prefix) for _ in range(4)]
        try:
            return await asyncio.gather(
                *[gateways[v % 4].pin_session("acme", session, v if v % 5 else None, 60) for v in range(80)]
            )
        finally:
            for g in gateways:
                await g.close()

    results = asyncio.run(body())
    assert len({r for r in results if r is not None}) == 1


def test_unknown_version_is_filled_by_the_first_concrete_one(make_state):
    s = _id()

    async def body(state) -> None:
        assert not await state.session_exists("acme", s)
        assert await state.pin_session("acme", s, None, 60) is None
        assert await state.session_exists("acme", s) and await state.session_version("acme", s) is None
        assert await state.pin_session("acme", s, 5, 60) == 5
        assert await state.pin_session("acme", s, 7, 60) == 5
        assert await state.pin_session("acme", s, None, 60) == 5
        await state.set_session_version("acme", s, 7, 60)  # forced repin
        assert await state.pin_session("acme", s, 9, 60) == 7 and await state.session_version("acme", s) == 7
        assert await state.pin_session("acme", s, 0, 60) == 7
        assert await state.pin_session("acme", _id(), 0, 60) == 0  # version 0 is a version, not "unknown"

    run(make_state, body)


def test_sessions_are_scoped_by_tenant(make_state):
    s = _id()

    async def body(state) -> None:
        assert await state.pin_session("acme", s, 1, 60) == 1
        assert not await state.session_exists("evil", s)
        assert await state.pin_session("evil", s, 2, 60) == 2  # the same id is another session
        assert await state.session_version("acme", s) == 1 and await state.session_version("evil", s) == 2
        # Separators in names cannot make two tenants' sessions meet.
        assert await state.pin_session("a:b", "c", 3, 60) == 3
        assert await state.pin_session("a", "b:c", 4, 60) == 4
        assert not await state.session_exists("a", "b")
        assert await state.session_version("a:b", "c") == 3

    run(make_state, body)


def test_entries_expire_and_pins_refresh_the_ttl(make_state):
    s, quiet, gen = _id(), _id(), _id()

    async def body(state) -> None:
        await state.pin_session("acme", s, 3, 0.4)
        await state.pin_session("acme", quiet, 3, 0.4)
        await state.record_generation(gen, "acme", s, 0.4)
        await asyncio.sleep(0.25)
        assert await state.pin_session("acme", s, 9, 0.4) == 3  # refreshed for another 0.4 s
        await asyncio.sleep(0.25)
        assert await state.session_version("acme", s) == 3
        assert not await state.session_exists("acme", quiet)
        assert await state.generation_owner(gen) is None
        await asyncio.sleep(0.25)
        assert not await state.session_exists("acme", s)
        assert await state.pin_session("acme", s, 9, 0.4) == 9  # a new life, a new pin

    run(make_state, body)


def test_generation_owners(make_state):
    gen = _id()

    async def body(state) -> None:
        assert await state.generation_owner(gen) is None
        await state.record_generation(gen, "acme", "s:1 with spaces", 60)
        assert await state.generation_owner(gen) == ("acme", "s:1 with spaces")
        assert await state.generation_owner(_id()) is None

    run(make_state, body)


def test_tenant_pins(make_state):
    async def body(state) -> None:
        assert await state.get_pins() == {}
        await state.set_pin("acme", 4)
        await state.set_pin("beta", 0)
        await state.set_pin("acme", 5)
        assert await state.get_pins() == {"acme": 5, "beta": 0}
        await state.set_pin("acme", None)
        await state.set_pin("nobody", None)
        assert await state.get_pins() == {"beta": 0}

    run(make_state, body)


def test_bad_ttl_is_rejected(make_state):
    async def body(state) -> None:
        for ttl in (0, -1.0):
            with pytest.raises(ValueError):
                await state.pin_session("acme", "s", 1, ttl)
            with pytest.raises(ValueError):
                await state.record_generation("g", "acme", "s", ttl)

    run(make_state, body)


def test_memory_state_is_bounded():
    async def body() -> None:
        state = MemoryState(max_entries=3)
        for i in range(5):
            await state.pin_session("acme", f"s{i}", i, 60)
            await state.record_generation(f"g{i}", "acme", f"s{i}", 60)
        assert [await state.session_exists("acme", f"s{i}") for i in range(5)] == [False, False, True, True, True]
        assert [await state.generation_owner(f"g{i}") for i in range(5)][:2] == [None, None]

    asyncio.run(body())


def test_unreachable_redis_raises_state_unavailable():
    async def body() -> None:
        state = RedisState(f"redis://127.0.0.1:{free_port()}/0", "x:", socket_timeout_s=0.5)
        try:
            start = time.monotonic()
            with pytest.raises(StateUnavailable, match="Redis"):
                await state.admit("k", 60, 1)
            with pytest.raises(StateUnavailable):
                await state.pin_session("acme", "s", 1, 60)
            assert time.monotonic() - start < 10
        finally:
            await state.close()

    asyncio.run(body())


# Ownership -----------------------------------------------------------------------------------


@pytest.fixture(params=[("sqlite", "memory"), ("postgresql", "redis")], ids=["sqlite+memory", "postgresql+redis"])
def stack(request: pytest.FixtureRequest):
    """(session factory, state factory) on a migrated database and a live-state backend."""
    from flywheel.db.session import upgrade

    db, live = request.param
    url = request.getfixturevalue("sqlite_url" if db == "sqlite" else "pg_url")
    upgrade(url)
    engine = make_engine(url)
    if live == "memory":
        make = MemoryState
    else:
        redis_url, prefix = request.getfixturevalue("redis_url"), request.getfixturevalue("live_prefix")
        make = lambda: RedisState(redis_url, prefix)  # noqa: E731
    yield make_session_factory(engine), make
    engine.dispose()


def _store_generation(sessions, tenant: str, session_id: str) -> str:
    generation_id = _id()
    with sessions() as s:
        s.add(Generation(event_id=_id(), generation_id=generation_id, tenant=tenant, session_id=session_id,
                         model_line="tiny-sim", model_version=1, node_id="node-0",
                         ts=datetime.now(UTC), payload={}))
        s.commit()
    return generation_id


def _refusal(coro: Awaitable[Any]) -> APIError:
    async def go() -> APIError:
        with pytest.raises(APIError) as caught:
            await coro
        return caught.value

    return go()


def test_generation_ownership_live_and_from_the_database(stack):
    sessions, make = stack
    live_gen, live_session = _id(), _id()
    old_session = _id()
    old_gen = _store_generation(sessions, "acme", old_session)  # expired from live state, ingested

    async def body(state) -> None:
        owner = Ownership(state, sessions, ttl_s=60)
        await state.record_generation(live_gen, "acme", live_session, 60)
        assert await owner.check_generation("acme", live_gen) == live_session
        assert await owner.check_generation("acme", live_gen, live_session) == live_session

        assert await state.generation_owner(old_gen) is None
        assert await owner.check_generation("acme", old_gen) == old_session
        assert await state.generation_owner(old_gen) == ("acme", old_session)  # back in live state

        missing = _id()
        answers = {}
        for name, gen, tenant in (("other tenant, live", live_gen, "evil"), ("other tenant, db", old_gen, "evil"),
                                  ("nowhere", missing, "acme"), ("nowhere, other", missing, "evil")):
            err = await _refusal(owner.check_generation(tenant, gen, param="generation_id"))
            assert (err.status, err.code, err.param) == (404, "generation_not_found", "generation_id"), name
            answers[name] = err.message.replace(gen, "<id>")
        assert len(set(answers.values())) == 1, answers
        assert "not found for this API key" in answers["nowhere"]

        err = await _refusal(owner.check_generation("acme", live_gen, "another-session"))
        assert err.status == 400 and err.code == "session_mismatch"

    run(make, body)


def test_session_ownership_live_and_from_the_database(stack):
    sessions, make = stack
    live_session, gen_session, closed_session = _id(), _id(), _id()
    _store_generation(sessions, "acme", gen_session)
    with sessions() as s:
        s.add(SessionState(tenant="acme", session_id=closed_session, status="closed",
                           last_event_at=datetime.now(UTC), closed_at=datetime.now(UTC)))
        s.commit()

    async def body(state) -> None:
        owner = Ownership(state, sessions, ttl_s=60)
        await state.pin_session("acme", live_session, 2, 60)
        for session_id in (live_session, gen_session, closed_session):
            await owner.check_session("acme", session_id)
        messages = set()
        for tenant, session_id in (("evil", live_session), ("evil", gen_session), ("evil", closed_session),
                                   ("acme", "never-seen"), ("evil", "never-seen")):
            err = await _refusal(owner.check_session(tenant, session_id))
            assert (err.status, err.code) == (404, "session_not_found")
            messages.add(err.message.replace(session_id, "<id>"))
        assert len(messages) == 1

    run(make, body)
