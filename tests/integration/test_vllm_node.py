"""``flywheel node`` with ``node.engine = "vllm"``: the node process keeps a vLLM server (the stand-in
that follows vLLM's HTTP contract, tests/fixtures/vllm_standin.py) on the registry's stable
version: it registers the weights vLLM started from, reloads each promoted version in place, and
keeps the last good one when a version is corrupt, reporting it in its heartbeat."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest
from sqlalchemy import select

from flywheel.db.models import Node
from flywheel.db.session import make_engine, make_session_factory, upgrade
from flywheel.settings import SettingsError, load_settings
from flywheel.weights.codec import encode_full
from flywheel.weights.registry import Registry
from flywheel.weights.store import FolderStore
from serving.node.main import run as run_node
from tests.fixtures.roles import RoleThread, wait_until
from tests.fixtures.vllm_standin import VllmStandIn
from tests.integration.test_registry import make_state, train_step

pytestmark = pytest.mark.integration


def test_a_vllm_node_follows_the_registry_and_keeps_the_last_good_version(tmp_path: Path) -> None:
    rng = random.Random(8)
    base = make_state(rng)
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(encode_full(base))  # what vLLM was started from
    db_url = f"sqlite:///{tmp_path / 'fw.db'}"
    upgrade(db_url)
    db = make_engine(db_url)
    sessions = make_session_factory(db)
    registry = Registry(sessions, FolderStore(tmp_path / "weights"), "vllm-line")

    def live_version() -> tuple[int | None, str]:
        with sessions() as s:
            row = s.scalar(select(Node).where(Node.node_id == "vllm-0"))
            return (row.live_version, row.status) if row is not None else (None, "")

    stop = threading.Event()
    with VllmStandIn() as standin:
        settings = load_settings(data_dir=str(tmp_path), db={"url": db_url},
                                 model={"line": "vllm-line", "path": str(model)},
                                 node={"engine": "vllm", "vllm_url": standin.url, "node_id": "vllm-0", "poll_s": 0.2})
        node = RoleThread("vllm-node", run_node, settings, stop)
        node.start()
        try:
            wait_until("the base registered and live", lambda: live_version() == (0, "serving"), timeout_s=30)
            assert registry.get(0).status == "stable" and not standin.calls  # nothing reloaded for the base

            v1 = registry.publish(train_step(rng, base), parent=0, parent_state=base)
            registry.set_status(v1.version, "stable", reason="test")
            wait_until("vLLM on v1", lambda: live_version() == (1, "serving"), timeout_s=30)
            assert standin.weights_sha256 == v1.sha256
            assert [c.path for c in standin.calls] == ["/pause", "/collective_rpc", "/reset_prefix_cache", "/resume"]

            state1 = registry.load(1)
            v2 = registry.publish(train_step(rng, state1), parent=1, parent_state=state1)
            blob = bytearray(registry.store.get(v2.store_key))
            blob[-3] ^= 0xFF
            registry.store.put(v2.store_key, bytes(blob))
            registry.set_status(v2.version, "stable", reason="test: corrupt")
            wait_until("the failure reported", lambda: live_version() == (1, "failed_update"), timeout_s=30)
            assert standin.weights_sha256 == v1.sha256  # the corrupt version never reached vLLM
            assert node.error is None and node.is_alive()
        finally:
            stop.set()
            node.join(timeout=30)
            db.dispose()
    assert node.error is None


def test_a_vllm_node_needs_its_url() -> None:
    with pytest.raises(SettingsError, match="vllm_url"):
        load_settings(node={"engine": "vllm"})
