"""Registry versions rebuilt into files (flywheel/weights/files.py): a vLLM node's path.

Every kind of object a chain holds (anchors, deltas, sharded anchors and deltas, plain safetensors
from before anchors) rebuilds, from a base the node holds or from the nearest anchor, into a file
with the version's hash; a damaged object, a foreign base or a lost shard leaves the output as it
was and no step file behind; and a node applying a delta holds a few tensors, not the model, as
does the registry's check of a delta it publishes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from flywheel.db.session import make_engine, make_session_factory, upgrade
from flywheel.weights import files
from flywheel.weights.codec.state import encode_full, state_sha256
from flywheel.weights.files import files_digest, rebuild_file
from flywheel.weights.registry import Registry, WeightsError
from flywheel.weights.shards import object_keys, read_manifest
from flywheel.weights.store import FolderStore, RegionalCache
from tests.integration.test_shard_publish import make_state, shard_manifest, step

pytestmark = pytest.mark.integration

LINE = "shards"  # the shard helpers' key prefix


def registry_at(folder: Path, full_every: int = 4) -> Registry:
    url = f"sqlite:///{folder / 'registry.db'}"
    upgrade(url)
    return Registry(make_session_factory(make_engine(url)), FolderStore(folder / "store"), LINE, full_every=full_every)


def file_of(tmp_path: Path, name: str, state: dict[str, torch.Tensor]) -> Path:
    path = tmp_path / name
    path.write_bytes(encode_full(state))
    return path


def same(path: Path, state: dict[str, torch.Tensor]) -> bool:
    got = safetensors.torch.load_file(path)
    return got.keys() == state.keys() and all(torch.equal(got[n].view(torch.uint8), state[n].view(torch.uint8))
                                              for n in state)


def chain(seed: int, n: int) -> list[dict[str, torch.Tensor]]:
    """``n`` states, each a few one-ULP steps on the one before."""
    states = [make_state(seed)]
    for i in range(1, n):
        states.append(step(states[-1], i))
    return states


def test_every_kind_of_version_rebuilds_into_a_file_with_its_hash(tmp_path: Path) -> None:
    registry = registry_at(tmp_path)
    store = registry.store
    states = chain(3, 7)
    registry.publish_manifest(shard_manifest(store, states[0], None, token="a"), parent=None)  # v0 sharded anchor
    registry.publish_manifest(shard_manifest(store, states[1], states[0], token="b"), parent=0)  # v1 sharded delta
    registry.publish(states[2], parent=1, parent_state=states[1])  # v2 delta on a sharded parent
    registry.publish(states[3], parent=2, parent_state=states[2])  # v3 delta
    registry.publish(states[4], parent=3, parent_state=states[3])  # v4 anchor (full_every=4)
    registry.publish(states[5], parent=4, parent_state=states[4])  # v5 delta
    legacy = tmp_path / "legacy"  # a full object stored before anchors: plain safetensors
    old = registry_at(legacy)
    old.publish(states[0], parent=None)
    store_key = old.get(0).store_key
    old.store.put(store_key, encode_full(states[0]))
    out = tmp_path / "out.safetensors"
    assert [i.kind for i in registry.versions()] == ["full", "delta", "delta", "delta", "full", "delta"]

    for version, state in enumerate(states[:6]):  # from the nearest anchor
        assert rebuild_file(registry, version, out) == state_sha256(state)
        assert same(out, state) and files_digest([out])[0] == state_sha256(state)
    region = RegionalCache(store, FolderStore(tmp_path / "eu"))  # a node's read path: anchors pulled by ranges
    via = Registry(registry.sessions, region, LINE, full_every=4)
    assert rebuild_file(via, 5, out) == state_sha256(states[5]) and same(out, states[5])
    assert rebuild_file(via, 1, out) == state_sha256(states[1])
    assert set(region.pulled()) == set(object_keys(store, registry.get(0).store_key)) | {
        registry.get(i).store_key for i in (4, 5)} | set(object_keys(store, registry.get(1).store_key))
    assert rebuild_file(old, 0, out) == state_sha256(states[0]) and same(out, states[0])

    base = file_of(tmp_path, "v1.safetensors", states[1])  # a node on v1 (written as vLLM's folder has it)
    assert rebuild_file(registry, 3, out, base=(1, [base])) == state_sha256(states[3]) and same(out, states[3])
    assert rebuild_file(registry, 1, out, base=(1, [base])) == state_sha256(states[1])  # itself: a checked copy
    halves = [dict(list(states[0].items())[:3]), dict(list(states[0].items())[3:])]  # a folder of two shards
    paths = [file_of(tmp_path, f"model-0000{i}-of-00002.safetensors", h) for i, h in enumerate(halves, 1)]
    assert rebuild_file(registry, 2, out, base=(0, paths)) == state_sha256(states[2]) and same(out, states[2])
    assert rebuild_file(registry, 5, out, base=(1, [base])) == state_sha256(states[5])  # v4 anchor: base unused
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".rebuild")) == []


def test_a_damaged_object_a_foreign_base_or_a_lost_shard_leaves_the_output_alone(tmp_path: Path) -> None:
    registry = registry_at(tmp_path)
    store = registry.store
    states = chain(5, 4)
    registry.publish(states[0], parent=None)
    registry.publish(states[1], parent=0, parent_state=states[0])
    registry.publish_manifest(shard_manifest(store, states[2], states[1], token="c"), parent=1)
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"what the node serves")
    v0 = file_of(tmp_path, "v0.safetensors", states[0])

    def refused(match: str, version: int, base: tuple | None = None) -> None:
        with pytest.raises(WeightsError, match=match):
            rebuild_file(registry, version, out, base=base)
        assert out.read_bytes() == b"what the node serves"
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".rebuild")] == []

    refused("different parent", 1, (0, [file_of(tmp_path, "foreign.safetensors", states[3])]))
    key = registry.get(1).store_key
    good = store.get(key)
    store.put(key, good[:-9] + bytes([good[-9] ^ 0x10]) + good[-8:])  # one bit flipped in the payload
    refused("version 1", 1, (0, [v0]))
    store.put(key, good)
    shard = read_manifest(store.get(registry.get(2).store_key)).shards[0]
    blob = store.get(shard.key)
    store.delete(shard.key)
    refused("unavailable", 2, (0, [v0]))
    store.put(shard.key, blob[:-1] + bytes([blob[-1] ^ 1]))
    refused("corrupt", 2, (0, [v0]))
    anchor = registry.get(0).store_key
    whole = store.get(anchor)
    store.put(anchor, whole[: len(whole) // 2] + bytes([whole[len(whole) // 2] ^ 4]) + whole[len(whole) // 2 + 1 :])
    refused("version 0", 1)
    store.put(anchor, whole)
    store.put(shard.key, blob)
    assert rebuild_file(registry, 2, out, base=(0, [v0])) == state_sha256(states[2]) and same(out, states[2])


def test_a_node_versions_behind_rebuilds_the_chain_in_one_pass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Five deltas behind (one of them sharded, one adding a tensor and one dropping one), a node
    writes one file, not one per version; cut into passes of one version each it writes five and
    gets the same bytes; a bit flipped in the fourth delta, or a foreign base, is blamed on the
    version it belongs to, and nothing is written."""
    registry = registry_at(tmp_path, full_every=50)
    states = chain(8, 6)
    states[3] = {**states[3], "head": torch.full((16, 8), 0.5).bfloat16()}  # v3 adds a tensor
    states[4] = {n: t for n, t in step(states[3], 40).items() if n != "layer.0.w"}  # v4 drops one
    states[5] = step(states[4], 50)
    registry.publish(states[0], parent=None)
    registry.publish_manifest(shard_manifest(registry.store, states[1], states[0], token="s"), parent=0)
    for v in range(2, 6):
        assert registry.publish(states[v], parent=v - 1, parent_state=states[v - 1]).kind == "delta"
    base = file_of(tmp_path, "v0.safetensors", states[0])
    writers: list[int] = []

    class Counted(files.TensorWriter):
        def __init__(self, *args: object, **kwargs: object) -> None:
            writers.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(files, "TensorWriter", Counted)
    out, apart = tmp_path / "v5.safetensors", tmp_path / "v5-apart.safetensors"
    assert rebuild_file(registry, 5, out, base=(0, [base])) == state_sha256(states[5]) and same(out, states[5])
    assert len(writers) == 1
    monkeypatch.setattr(files, "PASS_BYTES", 1)
    assert rebuild_file(registry, 5, apart, base=(0, [base])) == state_sha256(states[5])
    assert len(writers) == 6 and apart.read_bytes() == out.read_bytes()
    monkeypatch.setattr(files, "PASS_BYTES", 1 << 30)

    key = registry.get(4).store_key
    good = registry.store.get(key)
    registry.store.put(key, good[:-9] + bytes([good[-9] ^ 0x10]) + good[-8:])
    for target in (out, apart):
        with pytest.raises(WeightsError, match="^version 4 "):
            rebuild_file(registry, 5, target, base=(0, [base]))
        monkeypatch.setattr(files, "PASS_BYTES", 1)
    registry.store.put(key, good)
    with pytest.raises(WeightsError, match="^version 1 .*different parent"):
        rebuild_file(registry, 5, out, base=(0, [file_of(tmp_path, "foreign.safetensors", states[2])]))
    assert same(out, states[5]) and [p.name for p in tmp_path.iterdir() if p.name.startswith(".rebuild")] == []


_MEASURE = """
import os
from flywheel.db.session import make_engine, make_session_factory
from flywheel.weights.files import rebuild_file
from flywheel.weights.registry import Registry
from flywheel.weights.store import FolderStore
registry = Registry(make_session_factory(make_engine(URL)), FolderStore(STORE), LINE)
rebuild_file(registry, 1, TINY_OUT, base=None)  # the kernels and pools warmed on a tiny line's anchor and delta
def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key + ":"))
registry = Registry(make_session_factory(make_engine(BIG_URL)), FolderStore(BIG_STORE), LINE)
open("/proc/self/clear_refs", "w").write("5")  # VmHWM, the peak, starts again from the current RSS
before = status("VmRSS")
JOB
print(status("VmHWM") - before)
"""


def test_a_node_applying_a_delta_holds_a_few_tensors_not_the_model(tmp_path: Path) -> None:
    """A line of 20 tensors of 4 MB (80 MB a version): rebuilding v1 from the v0 file the node
    holds, or from v0's anchor (53 MB, read by ranges), grows the peak RSS by a few tensors; the
    whole-state path (``registry.load`` and a written file, what a vLLM node did before) grows it
    by more than two models."""
    g = torch.Generator().manual_seed(0)
    v0 = {f"layer.{i}": (torch.randn(2048, 1024, generator=g) * 0.02).bfloat16() for i in range(20)}
    v1 = {n: (t.float() + torch.randn(t.shape, generator=g) * 2e-6).bfloat16() for n, t in v0.items()}  # ~2%
    big, tiny = tmp_path / "big", tmp_path / "tiny"
    big.mkdir(), tiny.mkdir()
    registry = registry_at(big, full_every=50)
    registry.publish(v0, parent=None)
    assert registry.publish(v1, parent=0, parent_state=v0).kind == "delta"
    small = registry_at(tiny)
    small.publish(make_state(1), parent=None)
    assert small.publish(step(make_state(1), 1), parent=0, parent_state=make_state(1)).kind == "delta"
    base = file_of(tmp_path, "v0.safetensors", v0)
    sha1, largest, model, anchor = state_sha256(v1), 2048 * 1024 * 2, base.stat().st_size, registry.get(0).bytes
    del v0, v1
    values = {"URL": f"sqlite:///{tiny / 'registry.db'}", "STORE": str(tiny / "store"), "LINE": LINE,
              "TINY_OUT": str(tmp_path / "tiny.safetensors"), "BIG_URL": f"sqlite:///{big / 'registry.db'}",
              "BIG_STORE": str(big / "store")}
    prelude = "".join(f"{k} = {v!r}\n" for k, v in values.items())

    def growth(job: str) -> int:
        done = subprocess.run([sys.executable, "-c", prelude + _MEASURE.replace("JOB", job)], capture_output=True,
                              text=True, check=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
        return int(done.stdout.split()[-1])

    streamed = growth(f"rebuild_file(registry, 1, {str(tmp_path / 'v1.safetensors')!r}, base=(0, [{str(base)!r}]))")
    anchored = growth(f"rebuild_file(registry, 1, {str(tmp_path / 'a1.safetensors')!r})")  # v0's anchor, by ranges
    whole = growth("from flywheel.weights.codec.state import decode_full, encode_full\n"
                   f"v0 = decode_full(open({str(base)!r}, 'rb').read())\n"
                   f"open({str(tmp_path / 'w1')!r}, 'wb').write(encode_full(registry.load(1, base=(0, v0))))")
    assert files_digest([tmp_path / "v1.safetensors"])[0] == sha1
    assert files_digest([tmp_path / "a1.safetensors"])[0] == sha1
    assert streamed < 8 * largest, f"{streamed / 2**20:.1f} MiB over the interpreter"
    # Decoding an anchor tensor holds its streams beside the planes and the tensor: a few more
    # tensors than a delta, still under the object itself (which a whole fetch would add).
    assert anchored < 10 * largest < anchor, f"from the anchor: {anchored / 2**20:.1f} MiB over the interpreter"
    assert whole > 2 * model, f"the whole-state path grew only {whole / 2**20:.1f} MiB"


def test_the_tensor_files_refuse_a_name_in_two_shards(tmp_path: Path) -> None:
    registry = registry_at(tmp_path)
    states = chain(1, 2)
    registry.publish(states[0], parent=None)
    registry.publish(states[1], parent=0, parent_state=states[0])
    twice = [file_of(tmp_path, "a.safetensors", states[0]), file_of(tmp_path, "b.safetensors", {"norm": torch.ones(32)})]
    with pytest.raises(WeightsError, match="is in both"):
        rebuild_file(registry, 1, tmp_path / "out", base=(0, twice))
    assert not (tmp_path / "out").exists()


def test_publishing_a_delta_checks_it_without_a_second_state(tmp_path: Path) -> None:
    """``Registry.publish`` reads its object back and decodes it before the row exists: tensor by
    tensor now (each hashed and dropped), where it rebuilt a whole second state before."""
    g = torch.Generator().manual_seed(1)
    v0 = {f"layer.{i}": (torch.randn(2048, 1024, generator=g) * 0.02).bfloat16() for i in range(20)}
    v1 = {n: (t.float() + torch.randn(t.shape, generator=g) * 2e-6).bfloat16() for n, t in v0.items()}
    big, tiny = tmp_path / "big", tmp_path / "tiny"
    big.mkdir(), tiny.mkdir()
    registry_at(big, full_every=50).publish(v0, parent=None)
    registry_at(tiny).publish(make_state(1), parent=None)
    a, b = file_of(tmp_path, "v0.safetensors", v0), file_of(tmp_path, "v1.safetensors", v1)
    state_bytes, largest = a.stat().st_size, 2048 * 1024 * 2
    del v0, v1
    code = f"""
from flywheel.db.session import make_engine, make_session_factory
from flywheel.weights.codec.state import decode_full
from flywheel.weights.registry import Registry
from flywheel.weights.store import FolderStore
def registry(folder):
    return Registry(make_session_factory(make_engine(f"sqlite:///{{folder}}/registry.db")), FolderStore(folder + "/store"),
                    {LINE!r}, full_every=50)
small = registry({str(tiny)!r})
small.publish(step(make_state(1), 1), parent=0, parent_state=make_state(1))  # kernels and pools warmed
v0, v1 = (decode_full(open(p, "rb").read()) for p in ({str(a)!r}, {str(b)!r}))
def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key + ":"))
open("/proc/self/clear_refs", "w").write("5")
before = status("VmRSS")
info = registry({str(big)!r}).publish(v1, parent=0, parent_state=v0)
print(info.kind, status("VmHWM") - before)
"""
    prelude = "from tests.integration.test_shard_publish import make_state, step\n"
    done = subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    kind, grew = done.stdout.split()[-2:]
    assert kind == "delta"
    assert int(grew) < 10 * largest < state_bytes, f"publishing grew {int(grew) / 2**20:.1f} MiB"
