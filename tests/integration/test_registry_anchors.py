"""Full versions as compressed anchors on a real database and folder store: published, verified and
loaded bit-exact; full objects stored as plain safetensors before still load; bytes shipped per
version and per region."""

from __future__ import annotations

import random
from datetime import UTC, datetime
from pathlib import Path

import pytest

from flywheel.db.models import ModelVersion
from flywheel.weights.codec.anchor import is_anchor, raw_bytes
from flywheel.weights.codec.state import encode_full, state_sha256
from flywheel.weights.registry import Registry, WeightsError
from flywheel.weights.store import FolderStore, RegionalCache
from tests.integration.test_registry import assert_bit_exact, make_state, publish_chain, train_step

pytestmark = pytest.mark.integration


def test_full_versions_are_compressed_anchors(sessions, tmp_path: Path, rng: random.Random) -> None:
    store = FolderStore(tmp_path / "store")
    registry = Registry(sessions, store, "line-anchor", full_every=3)
    states = [make_state(rng)]
    states[0]["layer.0.tied"] = states[0]["layer.0.w"]  # shared storage
    infos = [registry.publish(states[0], parent=None)]
    for v in range(1, 4):
        states.append(train_step(rng, states[-1]))
        infos.append(registry.publish(states[v], parent=v - 1, parent_state=states[v - 1]))
    assert [i.kind for i in infos] == ["full", "delta", "delta", "full"]
    for info, state in zip(infos, states, strict=True):
        data = store.get(info.store_key)
        assert info.bytes == len(data) and info.full_bytes == raw_bytes(state)
        if info.kind == "full":
            assert is_anchor(data) and info.bytes < 0.8 * info.full_bytes < len(encode_full(state))
        assert_bit_exact(registry.load(info.version), state)
    # A damaged anchor is refused, never loaded as other weights.
    damaged = bytearray(store.get(infos[3].store_key))
    damaged[-5] ^= 0x10
    store.put(infos[3].store_key, bytes(damaged))
    with pytest.raises(WeightsError, match="version 3"):
        registry.load(3)


def test_a_full_version_stored_as_safetensors_still_loads_and_anchors_its_chain(
        sessions, tmp_path: Path, rng: random.Random) -> None:
    store = FolderStore(tmp_path / "store")
    registry = Registry(sessions, store, "line-legacy", full_every=50)
    s0 = make_state(rng)
    blob = encode_full(s0)  # what a full version was before anchors were compressed
    key = "line-legacy/v00000000-0000abcd.full"
    store.put(key, blob)
    with sessions() as session, session.begin():
        session.add(ModelVersion(model_line="line-legacy", version=0, kind="full", parent=None,
                                 sha256=state_sha256(s0), store_key=key, bytes=len(blob), full_bytes=len(blob),
                                 metrics={}, status="candidate", created_at=datetime.now(UTC)))
    assert_bit_exact(registry.load(0), s0)
    s1 = train_step(rng, s0)
    info = registry.publish(s1, parent=0)  # the parent's weights come from the safetensors object
    assert info.kind == "delta"
    assert_bit_exact(registry.load(1), s1)


def test_bytes_shipped_per_version_chain_and_region(sessions, tmp_path: Path, rng: random.Random) -> None:
    origin = FolderStore(tmp_path / "origin")
    registry = Registry(sessions, origin, "line-ship", full_every=4)
    publish_chain(registry, rng, 6)
    infos = registry.versions()
    assert [i.kind for i in infos] == ["full", "delta", "delta", "delta", "full", "delta"]

    eu = RegionalCache(origin, FolderStore(tmp_path / "cache-eu"), region="eu")
    us = RegionalCache(origin, FolderStore(tmp_path / "cache-us"))
    Registry(sessions, eu, "line-ship").load(3)  # a node in eu walks v0 + three deltas
    Registry(sessions, eu, "line-ship").load(3)  # a second node: all local
    Registry(sessions, us, "line-ship").load(5)  # us: the v4 anchor and one delta
    assert us.region == "cache-us"

    shipped = registry.shipped({"eu": eu, "us": us})
    assert [s.version for s in shipped] == list(range(6))
    assert [s.anchor for s in shipped] == [0, 0, 0, 0, 4, 4]
    assert [s.chain_length for s in shipped] == [1, 2, 3, 4, 1, 2]
    for s, info in zip(shipped, infos, strict=True):
        assert s.bytes == info.bytes and s.full_bytes == info.full_bytes
        assert s.pct_of_full == pytest.approx(100 * info.bytes / info.full_bytes)
    assert shipped[3].chain_bytes == sum(i.bytes for i in infos[:4])
    assert shipped[3].chain_average == pytest.approx(shipped[3].chain_bytes / 4)
    assert shipped[3].chain_average_pct == pytest.approx(100 * shipped[3].chain_average / infos[3].full_bytes)
    assert [s.regions["eu"] for s in shipped] == [i.bytes for i in infos[:4]] + [0, 0]
    assert [s.regions["us"] for s in shipped] == [0, 0, 0, 0, infos[4].bytes, infos[5].bytes]
    assert Registry(sessions, eu, "line-ship").shipped() == [
        s.__class__(**{**s.__dict__, "regions": {"eu": s.regions["eu"]}}) for s in shipped]
    assert all(s.regions == {} for s in registry.shipped())  # no cache in front: nothing per region
    assert FolderStore(tmp_path / "cache-eu").list() == sorted(i.store_key for i in infos[:4])  # ledger hidden
