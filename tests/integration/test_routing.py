"""The gateway's Router against a real registry (SQLite and PostgreSQL) and real live state
(in-process and Redis): registry statuses, tenant pins, node heartbeats, caching and failures."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter

import pytest
import torch

from flywheel.db.session import make_session_factory
from flywheel.live import MemoryLive
from flywheel.settings import load_settings
from flywheel.weights.registry import Registry
from flywheel.weights.store import FolderStore
from serving.errors import APIError
from serving.gateway.routing import Router, new_session_version

pytestmark = pytest.mark.integration

LINE = "route-line"


@pytest.fixture(params=["memory", "redis"])
def live(request):
    if request.param == "memory":
        yield MemoryLive()
    else:
        yield request.getfixturevalue("redis_live")


@pytest.fixture
def registry(sessions, tmp_path):
    return Registry(sessions, FolderStore(tmp_path / "weights"), LINE)


def _settings(tmp_path, **gateway):
    return load_settings(data_dir=str(tmp_path), model={"line": LINE}, rollout={"canary_fraction": 0.25},
                         node={"port": 8123}, gateway=gateway)


def _publish(registry: Registry, n: int) -> None:
    state = {"w": torch.randn(32, 32).to(torch.bfloat16)}
    registry.publish(state, parent=None, force_full=True)
    for _ in range(n - 1):
        state = {"w": state["w"] + 1}
        registry.publish(state, parent=None, force_full=True)


def _beat(live, node_id: str, versions: list[int], line: str = LINE, ttl_s: float = 30.0,
          live_version: int | None = None) -> None:
    live.heartbeat(node_id, {"node_id": node_id, "url": f"http://{node_id}:8100/", "model_line": line,
                             "live_version": versions[-1] if live_version is None else live_version,
                             "versions": versions, "status": "serving"}, ttl_s=ttl_s)


def test_the_table_follows_the_registry_and_the_pins(tmp_path, sessions, registry, live):
    _publish(registry, 4)
    pins = {"acme": 1}

    async def read_pins():
        return pins

    router = Router(_settings(tmp_path), sessions, live, read_pins, cache_s=0.05)

    async def scenario():
        table = await router.table()
        assert (table.stable, table.canary, table.canary_fraction, dict(table.pins)) == (None, None, 0.25, {"acme": 1})
        assert new_session_version(table, "other", "s") is None  # nothing stable yet

        registry.set_status(2, "stable", reason="test")
        registry.set_status(3, "canary", reason="test")
        pins["beta"] = 0
        await asyncio.sleep(0.06)
        stale = await router.table()  # served from the snapshot at once; a refresh starts behind it
        assert stale.stable is None
        await router.refresh()
        table = await router.table()
        assert (table.stable, table.canary, dict(table.pins)) == (2, 3, {"acme": 1, "beta": 0})

        split = Counter(new_session_version(table, "other", uuid.uuid4().hex) for _ in range(4000))
        assert set(split) == {2, 3} and abs(split[3] / 4000 - 0.25) < 0.03
        assert new_session_version(table, "acme", "s") == 1 and new_session_version(table, "beta", "s") == 0
        await router.close()

    asyncio.run(scenario())


def test_upstreams_are_nodes_holding_the_version_spread_evenly(tmp_path, sessions, registry, live):
    _publish(registry, 3)
    registry.set_status(2, "stable", reason="test")
    _beat(live, "node-a", [1, 2])
    _beat(live, "node-b", [2])
    _beat(live, "node-other-line", [0, 1, 2], line="another-line")
    _beat(live, "node-short", [0], ttl_s=0.3)
    router = Router(_settings(tmp_path, upstream="http://vllm.internal:8000/"), sessions, live, cache_s=0.05)

    async def scenario():
        await router.refresh()
        picks = Counter(router.upstream_for(2) for _ in range(100))
        assert picks == {"http://node-a:8100": 50, "http://node-b:8100": 50}
        assert {router.upstream_for(1) for _ in range(10)} == {"http://node-a:8100"}
        assert router.upstream_for(0) == "http://node-short:8100"
        assert router.upstream_for(7) == "http://vllm.internal:8000"  # held nowhere: the configured upstream
        assert set(router.upstream_for(None) for _ in range(12)) == {
            "http://node-a:8100", "http://node-b:8100", "http://node-short:8100"}

        shown = router.live_versions()
        assert shown["model_line"] == LINE and (shown["stable"], shown["canary"]) == (2, None)
        assert shown["versions"] == [{"version": 0, "nodes": ["node-short"]}, {"version": 1, "nodes": ["node-a"]},
                                     {"version": 2, "nodes": ["node-a", "node-b"]}]
        assert [n["node_id"] for n in shown["nodes"]] == ["node-a", "node-b", "node-short"]
        assert "url" not in str(shown) and "8100" not in str(shown)  # node addresses stay inside

        await asyncio.sleep(0.35)  # node-short's heartbeat expires
        router.upstream_for(0)  # stale: starts a refresh
        await router.refresh()
        assert router.upstream_for(0) == "http://vllm.internal:8000"
        await router.close()

    asyncio.run(scenario())


def test_new_sessions_wait_for_the_fleet_to_hold_a_promoted_version(tmp_path, sessions, registry, live):
    _publish(registry, 4)
    registry.set_status(1, "stable", reason="test")
    _beat(live, "node-a", [0, 1])
    router = Router(_settings(tmp_path), sessions, live)

    async def table():
        await router.refresh()
        t = await router.table()
        return t.stable, t.canary

    assert asyncio.run(table()) == (1, None)
    registry.set_status(2, "stable", reason="test")
    registry.set_status(3, "canary", reason="test")
    assert asyncio.run(table()) == (1, None)  # the node still serves 1 and does not hold 3 yet
    _beat(live, "node-a", [0, 1, 3], live_version=1)
    assert asyncio.run(table()) == (1, 3)
    _beat(live, "node-a", [1, 2, 3], live_version=2)
    assert asyncio.run(table()) == (2, 3)


def test_without_a_holder_or_upstream_any_node_then_the_local_node_serves(tmp_path, sessions, live):
    router = Router(_settings(tmp_path), sessions, live)

    async def scenario():
        await router.refresh()
        alone = router.upstream_for(3), router.upstream_for(None)
        _beat(live, "node-a", [1])
        await router.refresh()
        return alone, router.upstream_for(3)  # node-a will answer 409 version_unavailable

    assert asyncio.run(scenario()) == (("http://127.0.0.1:8123", "http://127.0.0.1:8123"), "http://node-a:8100")


def test_a_failing_source_keeps_its_last_value(tmp_path, sessions, registry, live):
    _publish(registry, 1)
    registry.set_status(0, "stable", reason="test")
    failing = False

    async def read_pins():
        if failing:
            raise ConnectionError("redis is down")
        return {"acme": 0}

    router = Router(_settings(tmp_path), sessions, live, read_pins, cache_s=0.01)

    async def scenario():
        nonlocal failing
        assert dict((await router.table()).pins) == {"acme": 0}
        failing = True
        await asyncio.sleep(0.02)
        await router.refresh()
        table = await router.table()
        assert (table.stable, dict(table.pins)) == (0, {"acme": 0})
        await router.close()

    asyncio.run(scenario())


def test_an_unreachable_registry_is_a_503_until_it_answers(tmp_path):
    from sqlalchemy import create_engine

    db = create_engine("postgresql+psycopg2://nobody@127.0.0.1:9/none", connect_args={"connect_timeout": 1})
    router = Router(_settings(tmp_path), make_session_factory(db), MemoryLive(), cache_s=10.0)

    async def scenario():
        with pytest.raises(APIError) as err:
            await router.table()
        assert err.value.status == 503 and err.value.code == "routing_unavailable"
        started = time.monotonic()
        with pytest.raises(APIError):  # within cache_s: no second attempt, an immediate answer
            await router.table()
        assert time.monotonic() - started < 0.05
        await router.close()

    asyncio.run(scenario())
    db.dispose()


def test_a_node_that_names_versions_by_model_gets_the_name_of_the_version(tmp_path, sessions, registry, live):
    """A LoRA-mode vLLM node's heartbeat carries ``model_names``: the target names the model for the
    session's version (its live one for no version); other nodes are targeted as before."""
    _publish(registry, 3)
    registry.set_status(1, "stable", reason="test")
    live.heartbeat("vllm-a", {"node_id": "vllm-a", "url": "http://vllm-a:8000", "model_line": LINE,
                              "live_version": 1, "versions": [0, 1],
                              "model_names": {"0": f"{LINE}-v0", "1": f"{LINE}-v1"}}, ttl_s=30)
    router = Router(_settings(tmp_path), sessions, live)

    async def scenario():
        await router.refresh()
        targets = (router.target_for(0), router.target_for(1), router.target_for(None), router.target_for(2))
        _beat(live, "node-b", [1, 2])
        await router.refresh()
        return targets, {router.target_for(2) for _ in range(4)}

    (t0, t1, t_none, t2), with_b = asyncio.run(scenario())
    assert (t0.url, t0.node_id, t0.model, t0.version) == ("http://vllm-a:8000", "vllm-a", f"{LINE}-v0", 0)
    assert (t1.model, t1.version, t_none.model, t_none.version) == (f"{LINE}-v1", 1, f"{LINE}-v1", 1)
    assert t2.url == "http://vllm-a:8000" and t2.unavailable  # held nowhere, and no name for it there
    (b,) = with_b
    assert (b.url, b.names_versions, b.model) == ("http://node-b:8100", False, None)
    assert router.upstream_for(1) in ("http://vllm-a:8000", "http://node-b:8100")
