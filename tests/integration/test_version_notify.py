"""Nodes learn of a promotion through a live-state notification, not at their next registry poll:
an updater polling every 60 s follows a promotion within a second, on Redis and in memory; with
Redis down it still follows at its poll."""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from flywheel.db.session import make_engine, make_session_factory, upgrade
from flywheel.live import MemoryLive, RedisLive
from flywheel.settings import Settings, load_settings
from flywheel.weights.registry import Registry
from flywheel.weights.store import FolderStore
from serving.node.main import bootstrap_version
from serving.node.updater import Updater, version_channel
from tests.fixtures.roles import wait_until
from tests.integration.test_registry import train_step

pytestmark = pytest.mark.integration


@contextmanager
def node(tiny_model_dir: Path, tmp_path: Path, settings: Settings, live: Any) -> Iterator[tuple[Any, Updater, Any]]:
    """A serving engine on the tiny model at version 0 of a fresh registry, with its updater
    started; yields the engine, the updater and the registry's session factory and store."""
    from serving.node.engine import Engine

    db_url = f"sqlite:///{tmp_path / 'fw.db'}"
    upgrade(db_url)
    db = make_engine(db_url)
    sessions = make_session_factory(db)
    store = FolderStore(tmp_path / "weights")
    engine = Engine(tiny_model_dir, settings)
    updater = Updater(engine, Registry(sessions, store, settings.model.line), settings, live=live)
    try:
        bootstrap_version(engine, Registry(sessions, store, settings.model.line))
        assert engine.current()[0] == 0
        updater.start()
        yield engine, updater, (sessions, store)
    finally:
        updater.stop()
        engine.close()
        db.dispose()


@pytest.mark.parametrize("kind", ["redis", "memory"])
def test_a_promotion_reaches_a_slow_polling_node_at_once(kind: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    prefix = f"fw-test-{uuid.uuid4().hex[:8]}:"
    settings = load_settings(data_dir=str(tmp_path), node={"poll_s": 60.0}, live={"kind": kind, "key_prefix": prefix})
    live = RedisLive(settings.live.redis_url, prefix) if kind == "redis" else MemoryLive()
    try:
        with node(tiny_model_dir, tmp_path, settings, live) as (engine, _updater, (sessions, store)):
            if kind == "redis":  # the listener subscribes in its own thread
                import redis

                client = redis.Redis.from_url(settings.live.redis_url)
                channel = f"{prefix}channel:{version_channel(settings.model.line)}"
                wait_until("the node listening", lambda: client.pubsub_numsub(channel)[0][1] == 1, timeout_s=10)
                client.close()
            time.sleep(0.2)  # the first poll is done; the next is 60 s away
            publisher = Registry(sessions, store, settings.model.line,
                                 announce=lambda info: live.notify(version_channel(info.model_line)))
            state0 = engine.state()
            v1 = publisher.publish(train_step(random.Random(1), state0, 0.02), parent=0, parent_state=state0)
            promoted = time.perf_counter()
            publisher.set_status(v1.version, "stable", reason="test")
            wait_until("the node on v1", lambda: engine.current()[0] == v1.version, timeout_s=10, every_s=0.01)
            assert time.perf_counter() - promoted < 3.0
    finally:
        live.close()


def test_with_redis_down_the_node_still_follows_at_its_poll(tiny_model_dir: Path, tmp_path: Path) -> None:
    settings = load_settings(data_dir=str(tmp_path), node={"poll_s": 0.5})
    down = RedisLive("redis://127.0.0.1:1/0", "fw-down:", socket_timeout_s=0.2)  # nothing listens there
    with node(tiny_model_dir, tmp_path, settings, None) as (engine, updater, (sessions, store)):
        stop_listening = down.listen(version_channel(settings.model.line), updater._kick)  # keeps failing
        try:
            registry = Registry(sessions, store, settings.model.line)
            state0 = engine.state()
            v1 = registry.publish(train_step(random.Random(2), state0, 0.02), parent=0, parent_state=state0)
            registry.set_status(v1.version, "stable", reason="test")
            wait_until("the node on v1", lambda: engine.current()[0] == v1.version, timeout_s=10)
        finally:
            stop_listening()


def test_a_version_a_node_failed_to_load_is_retried_once_it_is_repaired_cleared_and_promoted_again(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    from serving.rollout_actions import manual_clear

    settings = load_settings(data_dir=str(tmp_path), node={"poll_s": 0.2})
    with node(tiny_model_dir, tmp_path, settings, None) as (engine, updater, (sessions, store)):
        registry = Registry(sessions, store, settings.model.line)
        state0 = engine.state()
        v1 = registry.publish(train_step(random.Random(3), state0, 0.02), parent=0, parent_state=state0)
        good = store.get(v1.store_key)
        store.put(v1.store_key, good[: len(good) // 2])  # a damaged object
        registry.set_status(v1.version, "stable", reason="test")
        wait_until("the load failing", lambda: updater.status == "failed_update", timeout_s=10)
        time.sleep(1.0)  # five polls: the damaged version is not retried over and over
        assert engine.current()[0] == 0 and updater.status == "failed_update"
        registry.set_status(v1.version, "rolled_back", reason="test: no node can load it")
        store.put(v1.store_key, good)  # repaired
        manual_clear(registry, v1.version, "test: object restored")
        registry.set_status(v1.version, "stable", reason="test: promoted again")
        wait_until("the node on v1", lambda: engine.current()[0] == v1.version, timeout_s=10)
        assert updater.status == "serving"
