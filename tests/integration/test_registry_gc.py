"""Registry upkeep on a real database and folder store: anchors when a delta chain grows too heavy,
squashed deltas between any two versions, and garbage collection that keeps whatever a live node,
a canary, a candidate or a rollback still needs."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from flywheel.db.models import Node
from flywheel.weights.codec.delta import apply_delta
from flywheel.weights.codec.state import state_sha256
from flywheel.weights.collect import collect, needed
from flywheel.weights.registry import Registry, WeightsError
from flywheel.weights.store import FolderStore
from tests.integration.test_registry import assert_bit_exact, make_state, train_step

pytestmark = pytest.mark.integration


def test_a_heavy_delta_chain_gets_a_full_anchor(sessions, tmp_path: Path) -> None:
    registry = Registry(sessions, FolderStore(tmp_path / "store"), "line-chain", full_every=1000, chain_max_ratio=0.3)
    rng = random.Random(3)
    states = [make_state(rng)]
    infos = [registry.publish(states[0], parent=None)]
    for v in range(1, 12):
        states.append(train_step(rng, states[-1], fraction=0.05))
        infos.append(registry.publish(states[v], parent=v - 1, parent_state=states[v - 1]))
    kinds = [i.kind for i in infos]
    assert kinds[0] == "full" and "full" in kinds[2:] and kinds.count("delta") >= 6
    # Between two anchors the deltas never add up to more than 0.3 of a full checkpoint.
    chain = 0
    for info in infos:
        chain = 0 if info.kind == "full" else chain + info.bytes
        assert chain <= 0.3 * info.full_bytes
    for info, state in zip(infos, states, strict=True):
        assert_bit_exact(registry.load(info.version), state)


def test_squash_gives_one_verified_delta_between_any_two_versions(sessions, tmp_path: Path) -> None:
    registry = Registry(sessions, FolderStore(tmp_path / "store"), "line-squash", full_every=1000)
    rng = random.Random(4)
    states = [make_state(rng)]
    registry.publish(states[0], parent=None)
    for v in range(1, 6):
        states.append(train_step(rng, states[-1]))
        registry.publish(states[v], parent=v - 1, parent_state=states[v - 1])
    forward = registry.squash(1, 5)
    assert_bit_exact(apply_delta(states[1], forward, old_sha256=state_sha256(states[1])), states[5])
    backward = registry.squash(5, 1)
    assert_bit_exact(apply_delta(states[5], backward), states[1])
    one_step = sum(registry.get(v).bytes for v in range(2, 6))
    assert len(forward) < one_step  # four steps of ~3% overlap: one delta beats the chain


def test_garbage_collection_keeps_what_nodes_canaries_candidates_and_rollbacks_need(sessions, tmp_path: Path) -> None:
    store = FolderStore(tmp_path / "store")
    registry = Registry(sessions, store, "line-gc", full_every=1000)
    rng = random.Random(5)
    states = {0: make_state(rng)}
    registry.publish(states[0], parent=None)
    parents = {1: 0, 2: 1, 3: 2, 4: 3, 5: 4, 6: 5, 7: 5, 8: 7}
    for v, parent in parents.items():
        states[v] = train_step(rng, states[parent])
        registry.publish(states[v], parent=parent, parent_state=states[parent], force_full=(v == 4))
    assert registry.get(4).kind == "full" and registry.get(5).kind == "delta"
    registry.set_status(0, "stable", "base")
    registry.set_status(3, "stable", "promoted")  # retires 0
    registry.set_status(5, "stable", "promoted")  # retires 3
    registry.set_status(6, "rolled_back", "canary lost")
    registry.set_status(7, "canary", "canary")
    now = datetime.now(UTC)
    with sessions() as db, db.begin():
        db.add(Node(node_id="n-live", region="eu", url="http://n1", model_line="line-gc", live_version=2,
                    status="serving", detail="", last_heartbeat=now))
        db.add(Node(node_id="n-gone", region="us", url="http://n2", model_line="line-gc", live_version=1,
                    status="serving", detail="", last_heartbeat=now - timedelta(hours=2)))

    # Kept: stable 5 (its chain: 4), canary 7, candidate 8, node n-live's 2 (chain 1, 0), and with
    # one rollback step the previous stable 3. The rolled-back 6 goes; the stale node keeps nothing.
    assert needed(registry, keep_rollback=1) == {0, 1, 2, 3, 4, 5, 7, 8}
    assert needed(registry, keep_rollback=0) == {0, 1, 2, 4, 5, 7, 8}
    keys = {v: registry.get(v).store_key for v in range(9)}
    assert collect(registry, keep_rollback=0, dry_run=True) == [3, 6]
    assert all(store.exists(k) for k in keys.values())
    assert collect(registry, keep_rollback=0) == [3, 6]
    assert not store.exists(keys[3]) and not store.exists(keys[6])
    assert [registry.get(v).status for v in (3, 6)] == ["collected", "collected"]
    assert registry.transitions(6)[-1]["to_status"] == "collected"
    with pytest.raises(WeightsError, match="garbage-collected"):
        registry.load(6)
    for v in (0, 1, 2, 4, 5, 7, 8):
        assert_bit_exact(registry.load(v), states[v])
    assert collect(registry, keep_rollback=0) == []  # nothing left to collect


def test_a_status_change_can_be_conditional_on_the_current_status(sessions, tmp_path: Path) -> None:
    from flywheel.weights.registry import StatusChanged

    registry = Registry(sessions, FolderStore(tmp_path / "store"), "line-cas")
    state = make_state(random.Random(6))
    registry.publish(state, parent=None)
    registry.set_status(0, "canary", "test", expect="candidate")
    with pytest.raises(StatusChanged):
        registry.set_status(0, "stable", "test", expect="candidate")  # it is a canary now
    assert registry.get(0).status == "canary" and [t["to_status"] for t in registry.transitions(0)] == [
        "candidate", "canary"]
