"""RegionalCache: each object crosses into a region once, however many nodes read it at once."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from flywheel.settings import load_settings
from flywheel.weights import store as store_module
from flywheel.weights.store import FolderStore, ObjectNotFound, RegionalCache, StoreError, make_store


class CountingOrigin(FolderStore):
    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gets = 0
        self._count = threading.Lock()

    def get(self, key: str) -> bytes:
        with self._count:
            self.gets += 1
        return super().get(key)


class RangeCountingOrigin(CountingOrigin):
    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.ranges: list[tuple[int, int]] = []

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        with self._count:
            self.ranges.append((offset, length))
        return super().get_range(key, offset, length)


def test_concurrent_readers_of_a_region_pull_each_object_once(tmp_path: Path) -> None:
    origin = CountingOrigin(tmp_path / "origin")
    origin.put("line/v00000001-ab.delta", b"d" * 100_000)
    region = [RegionalCache(origin, FolderStore(tmp_path / "eu-cache")) for _ in range(8)]  # 8 nodes
    start = threading.Barrier(len(region))
    got: list[bytes] = []

    def read(cache: RegionalCache) -> None:
        start.wait()
        got.append(cache.get("line/v00000001-ab.delta"))

    threads = [threading.Thread(target=read, args=(c,)) for c in region]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [b"d" * 100_000] * 8
    assert origin.gets == 1 and sum(c.pulled_bytes for c in region) == 100_000
    other = RegionalCache(origin, FolderStore(tmp_path / "us-cache"))
    assert other.get("line/v00000001-ab.delta") == b"d" * 100_000 and origin.gets == 2  # once per region
    assert FolderStore(tmp_path / "eu-cache").list() == ["line/v00000001-ab.delta"]  # the locks stay hidden


def test_writes_go_to_the_origin_and_deletes_drop_both(tmp_path: Path) -> None:
    origin = FolderStore(tmp_path / "origin")
    cache = RegionalCache(origin, FolderStore(tmp_path / "cache"))
    cache.put("line/v1.full", b"w")
    assert origin.get("line/v1.full") == b"w" and not FolderStore(tmp_path / "cache").exists("line/v1.full")
    assert cache.get("line/v1.full") == b"w" and FolderStore(tmp_path / "cache").exists("line/v1.full")
    cache.delete("line/v1.full")
    assert not cache.exists("line/v1.full")
    with pytest.raises(ObjectNotFound):
        cache.get("line/v1.full")


def test_ranges_pull_an_object_into_the_region_in_chunks_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node reading an anchor by ranges pulls it into the region's cache in chunks (never whole
    in memory), once, and then reads the cache; a folder store's ranges are exact or an error."""
    monkeypatch.setattr(store_module, "PULL_CHUNK", 4096)
    origin = RangeCountingOrigin(tmp_path / "origin")
    body = bytes(range(256)) * 100
    origin.put("line/v2-ab.full", body)
    region = [RegionalCache(origin, FolderStore(tmp_path / "eu")) for _ in range(2)]
    assert region[0].size("line/v2-ab.full") == len(body)
    assert region[0].get_range("line/v2-ab.full", 5000, 300) == body[5000:5300]
    assert region[1].get_range("line/v2-ab.full", 0, len(body)) == body
    assert origin.ranges == [(at, min(4096, len(body) - at)) for at in range(0, len(body), 4096)]  # one pull
    assert region[0].pulled() == {"line/v2-ab.full": len(body)} and origin.gets == 0
    cache = FolderStore(tmp_path / "eu")
    assert cache.get("line/v2-ab.full") == body and cache.size("line/v2-ab.full") == len(body)
    with pytest.raises(StoreError, match="ends at"):
        cache.get_range("line/v2-ab.full", len(body) - 2, 4)
    with pytest.raises(ObjectNotFound):
        region[0].get_range("line/v3-cd.full", 0, 1)


def test_settings_put_a_cache_in_front_of_the_store(tmp_path: Path) -> None:
    store = make_store(load_settings(None, data_dir=str(tmp_path), store={"cache_path": str(tmp_path / "c")}))
    assert isinstance(store, RegionalCache) and store.cache.root == tmp_path / "c"
    assert isinstance(make_store(load_settings(None, data_dir=str(tmp_path))), FolderStore)
