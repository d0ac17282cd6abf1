"""Sharded versions (flywheel/weights/shards.py, trainer/shard_publish.py): the same hash as whole ones, every shard checked.

In one process: a state cut into shards as two ranks would cut it, published as a manifest and
loaded back through the registry (a node's path), as an anchor and as a delta; a corrupt, missing
or foreign shard and a tampered manifest are refused, and garbage collection removes the shards.
Under torchrun (2 gloo ranks, FSDP2, bench/sharded_publish.py's worker on a small, deep Llama): a
sharded delta that a node rebuilds to the hash of the same weights gathered whole, published in
memory well under a shard; a lost shard upload refused on every rank; a rank killed mid-publish
(a tiny Llama) leaves no version; a mixture of experts' shards hold its checkpoint's names. In one
process, the inline publish point streamed as one shard against the gathered one it replaced.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from bench.sharded_publish import node_load, run_job
from flywheel.db.session import make_engine, make_session_factory, upgrade
from flywheel.weights.codec.state import DeltaError, state_sha256
from flywheel.weights.codec.tensorfile import StateReader
from flywheel.weights.collect import collect
from flywheel.weights.registry import Registry, WeightsError
from flywheel.weights.shards import (
    encode_shard,
    is_manifest,
    load_sharded,
    manifest_bytes,
    object_keys,
    owners,
    read_manifest,
    shard_key,
)
from flywheel.weights.store import FolderStore

pytestmark = pytest.mark.integration

LINE = "shards"


def make_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state = {f"layer.{i}.w": (torch.randn(64 + 8 * i, 32, generator=g) * 0.02).bfloat16() for i in range(5)}
    state["embed"] = (torch.randn(300, 32, generator=g) * 0.02).bfloat16()
    state["norm"] = torch.ones(32)
    return state


def step(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """A few percent of the bf16 weights move by one ULP."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        if t.dtype == torch.bfloat16:
            b = t.view(torch.int16)
            out[name] = torch.where(torch.rand(b.shape, generator=g) < 0.03, b + 1, b).view(torch.bfloat16)
        else:
            out[name] = t.clone()
    return out


def split(state: dict[str, torch.Tensor], world: int) -> list[dict[str, torch.Tensor]]:
    owner = owners({n: t.numel() * t.element_size() for n, t in state.items()}, world)
    return [{n: t for n, t in state.items() if owner[n] == r} for r in range(world)]


def shard_manifest(store: FolderStore, new: dict, old: dict | None, world: int = 2, token: str = "t0") -> bytes:
    """What ``world`` ranks upload for ``new`` (deltas on ``old``'s shards), and the manifest."""
    metas = []
    old_parts = split(old, world) if old is not None else [None] * world
    for rank, (part, base) in enumerate(zip(split(new, world), old_parts, strict=True)):
        kind = "full" if base is None else "delta"
        blob, meta = encode_shard(StateReader(part), None if base is None else StateReader(base), rank=rank,
                                  key=shard_key(LINE, token, rank, world, kind))
        store.put(meta.key, blob)
        metas.append(meta)
    return manifest_bytes(metas[0].kind, None if old is None else state_sha256(old), metas)


@pytest.fixture
def registry(tmp_path: Path) -> Registry:
    url = f"sqlite:///{tmp_path / 'registry.db'}"
    upgrade(url)
    return Registry(make_session_factory(make_engine(url)), FolderStore(tmp_path / "store"), LINE, full_every=4)


def test_owners_partition_by_bytes_the_same_way_every_time() -> None:
    sizes = {"a": 10, "b": 7, "c": 5, "d": 5, "e": 1}
    assert owners(sizes, 2) == owners(dict(reversed(sizes.items())), 2) == {"a": 0, "b": 1, "c": 1, "d": 0, "e": 1}
    assert set(owners(sizes, 8).values()) == {0, 1, 2, 3, 4}


def test_a_sharded_version_has_the_whole_states_hash_and_loads_like_one(registry: Registry) -> None:
    rng = random.Random(5)
    states = [make_state(rng.getrandbits(31))]
    states.append(step(states[0], 1))
    states.append(step(states[1], 2))
    store = registry.store
    v0 = registry.publish_manifest(shard_manifest(store, states[0], None, token="a"), parent=None)
    v1 = registry.publish_manifest(shard_manifest(store, states[1], states[0], token="b"), parent=0, train_step=1)
    whole = registry.publish(states[2], parent=1, parent_state=states[1])  # a whole delta on a sharded parent
    assert (v0.kind, v1.kind, whole.kind) == ("full", "delta", "delta")
    assert is_manifest(v0.store_key) and is_manifest(v1.store_key)
    for info, state in zip((v0, v1, whole), states, strict=True):
        assert info.sha256 == state_sha256(state)
        loaded = registry.load(info.version)
        assert state_sha256(loaded) == info.sha256 and loaded.keys() == state.keys()
        assert all(torch.equal(loaded[n].view(torch.uint8), state[n].view(torch.uint8)) for n in state)
    assert registry.load(1, base=(0, states[0]))["embed"].equal(states[1]["embed"])  # a node's update from v0
    manifest = read_manifest(store.get(v1.store_key))
    assert v1.bytes == manifest.stored_bytes + len(store.get(v1.store_key)) and v1.bytes < v0.bytes / 2
    assert 0 < v1.fraction_changed < 0.1
    # A delta manifest not on the parent's hash, or planned onto an anchor number, is refused.
    with pytest.raises(WeightsError, match="not on version 0"):
        registry.publish_manifest(shard_manifest(store, states[2], states[1], token="c"), parent=0)
    assert registry.sharded_kind(2) == "delta" and registry.sharded_kind(None) == "full"
    assert registry.sharded_kind(2, delta_bytes=v0.bytes, full_bytes=v0.full_bytes) == "full"  # would not pay
    states.append(step(states[2], 3))
    registry.publish(states[3], parent=2, parent_state=states[2])
    assert registry.sharded_kind(3) == "full"  # v4 is an anchor (full_every=4)
    with pytest.raises(WeightsError, match="must be an anchor"):
        registry.publish_manifest(shard_manifest(store, step(states[3], 4), states[3], token="d"), parent=3)
    assert [v.version for v in registry.versions()] == [0, 1, 2, 3]


def test_a_corrupt_missing_or_foreign_shard_is_refused(registry: Registry) -> None:
    store = registry.store
    states = [make_state(9)]
    states.append(step(states[0], 3))
    registry.publish_manifest(shard_manifest(store, states[0], None, token="a"), parent=None)
    v1 = registry.publish_manifest(shard_manifest(store, states[1], states[0], token="b"), parent=0)
    manifest = read_manifest(store.get(v1.store_key))
    key = manifest.shards[1].key
    good = store.get(key)
    store.put(key, good[:-1] + bytes([good[-1] ^ 1]))  # one bit flipped
    with pytest.raises(WeightsError, match="corrupt"):
        registry.load(1)
    store.delete(key)  # a lost shard
    with pytest.raises(WeightsError, match="unavailable"):
        registry.load(1)
    store.put(key, good)
    assert state_sha256(registry.load(1)) == v1.sha256
    # A manifest whose shard lists are tampered with does not compose to its hash.
    body = json.loads(store.get(v1.store_key))
    body["shards"][0]["tensors"][0][4] = "00" * 32
    with pytest.raises(DeltaError, match="do not match their tensors"):
        load_sharded(store, json.dumps(body).encode(), sha256=v1.sha256, base=states[0], base_sha256=body["base_sha256"])
    # The right shards on the wrong base: the rebuilt shard fails its hash.
    with pytest.raises(DeltaError):
        load_sharded(store, store.get(v1.store_key), sha256=v1.sha256, base=step(states[0], 8),
                     base_sha256=body["base_sha256"])
    # Garbage collection deletes a manifest's shards with it.
    keys = object_keys(store, v1.store_key)
    assert len(keys) == 3 and all(store.exists(k) for k in keys)
    registry.set_status(0, "stable", reason="test")
    registry.set_status(1, "rolled_back", reason="test")
    assert collect(registry, keep_rollback=0) == [1]
    assert not any(store.exists(k) for k in keys)


def rank0(root: Path, suffix: str = "") -> dict:
    return json.loads((root / f"rank0{suffix}.json").read_text())


def test_two_gloo_ranks_publish_a_sharded_delta_a_node_rebuilds(tmp_path: Path) -> None:
    """Both ranks code and upload their shard, holding neither it nor its parent's in memory; the
    node's load rebuilds the hash of the weights gathered whole; then rank 1's v2 upload is lost,
    and every rank refuses v2."""
    root = tmp_path / "sharded"
    proc = run_job(root, "sharded", "deep", 2, "--check", "--fault", "drop", timeout_s=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = rank0(root)
    assert (result["version"], result["kind"]) == (1, "delta")
    assert result["sha256"] == result["gathered_sha256"] == node_load(root, 1)
    # Rank 0's peak during the delta publish grows by a few of its (small) tensors and the delta:
    # ~20 MB on a 74 MB shard. Holding the new shard and its read-back copy grew it by twice the shard.
    growth = result["peak_mb"] - result["rss_before_mb"]
    assert growth < 0.5 * result["shard_mb"], (growth, result["shard_mb"])
    for rank in (0, 1):
        outcome = json.loads((root / f"rank{rank}-fault.json").read_text())["outcome"]
        assert outcome.startswith("refused") and "rank 1" in outcome, outcome
    registry = Registry(make_session_factory(make_engine(f"sqlite:///{root / 'registry.db'}")),
                        FolderStore(root / "store"), "bench")
    assert [v.version for v in registry.versions()] == [0, 1]
    manifests = {v.store_key for v in registry.versions()}
    shards = {k for key in manifests for k in object_keys(registry.store, key)}
    assert set(registry.store.list("bench/")) == shards  # the refused publish left nothing behind


def test_two_gloo_ranks_publish_a_mixture_of_experts_under_its_checkpoints_names(tmp_path: Path) -> None:
    """A tiny Qwen3-MoE under FSDP2: each fused expert tensor's owner writes it one tensor per expert,
    as the checkpoint holds it (flywheel/weightnames.py), and a node rebuilds the hash of the
    same weights gathered whole and exported as the unsharded path exports them."""
    root = tmp_path / "moe"
    proc = run_job(root, "sharded", "moe", 2, "--check", timeout_s=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = rank0(root)
    assert (result["version"], result["kind"]) == (1, "delta")
    assert result["sha256"] == result["gathered_sha256"] == node_load(root, 1)
    registry = Registry(make_session_factory(make_engine(f"sqlite:///{root / 'registry.db'}")),
                        FolderStore(root / "store"), "bench")
    names = registry.load(1).keys()
    assert "model.layers.1.mlp.experts.5.gate_proj.weight" in names
    assert not any(n.endswith("experts.gate_up_proj") for n in names)


def test_one_process_publishing_inline_streams_the_model_without_copying_it(tmp_path: Path) -> None:
    """The single-process trainer's inline publish point (one shard, DCP checkpoint: no process
    group) against the gathered one it replaced (master copy, ``checkpoint.save``, export against
    the kept parent), on the tests' deep Llama: the same v1, and a small fraction of the growth."""
    rows = {}
    for mode in ("gather+ckpt", "sharded+ckpt"):
        root = tmp_path / mode.replace("+", "-")
        proc = run_job(root, mode, "deep", 1, "--check", timeout_s=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        rows[mode] = rank0(root)
    streamed, gathered = rows["sharded+ckpt"], rows["gather+ckpt"]
    assert streamed["world_size"] == 1 and (streamed["kind"], gathered["kind"]) == ("delta", "delta")
    assert streamed["sha256"] == streamed["gathered_sha256"] == gathered["sha256"] == node_load(tmp_path / "sharded-ckpt", 1)
    growth = {mode: r["peak_mb"] - r["rss_before_mb"] for mode, r in rows.items()}
    # The gathered point copies the 310 MB master and writes it with the 620 MB of Adam state from
    # memory; the streamed one holds a few of its (small) tensors and the coder's buffers.
    assert growth["sharded+ckpt"] < 0.25 * growth["gather+ckpt"], growth


def test_a_rank_killed_mid_publish_leaves_no_version(tmp_path: Path) -> None:
    root = tmp_path / "killed"
    proc = run_job(root, "sharded", "tiny", 2, "--fault", "kill", timeout_s=240)
    assert proc.returncode != 0
    assert rank0(root)["version"] == 1
    registry = Registry(make_session_factory(make_engine(f"sqlite:///{root / 'registry.db'}")),
                        FolderStore(root / "store"), "bench")
    assert [v.version for v in registry.versions()] == [0, 1]
    assert state_sha256(registry.load(1)) == registry.get(1).sha256  # what nodes serve still loads
