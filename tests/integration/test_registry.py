"""The weight store and the version registry on a real database (SQLite and PostgreSQL) and folder."""

from __future__ import annotations

import os
import random
import threading
from pathlib import Path

import pytest
import torch

from flywheel.settings import load_settings
from flywheel.weights.codec.state import state_sha256
from flywheel.weights.collect import collect, needed
from flywheel.weights.registry import LinePinned, Registry, StatusChanged, VersionNotFound, WeightsError
from flywheel.weights.store import FolderStore, InvalidKey, ObjectNotFound, S3Store, make_store

pytestmark = pytest.mark.integration


@pytest.fixture
def store(tmp_path: Path) -> FolderStore:
    return FolderStore(tmp_path / "store")


def make_state(rng: random.Random) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(rng.getrandbits(63))
    return {
        "embed": (torch.randn(300, 64, generator=g) * 0.02).bfloat16(),
        "layer.0.w": (torch.randn(64, 64, generator=g) * 0.02).bfloat16(),
        "layer.0.b": torch.zeros(64, dtype=torch.bfloat16),
        "norm": torch.ones(64),
    }


def train_step(rng: random.Random, state: dict[str, torch.Tensor], fraction: float = 0.03) -> dict[str, torch.Tensor]:
    """A fake optimizer step: a few percent of the bf16 weights move by one ULP."""
    g = torch.Generator().manual_seed(rng.getrandbits(63))
    out = {}
    for name, t in state.items():
        if t.dtype == torch.bfloat16:
            b = t.clone().view(torch.int16)
            moved = torch.rand(b.shape, generator=g) < fraction
            out[name] = torch.where(moved, b + 1, b).view(torch.bfloat16)
        else:
            out[name] = t.clone()
    return out


def publish_chain(registry: Registry, rng: random.Random, n: int) -> list[dict[str, torch.Tensor]]:
    """Publish ``n`` versions on ``registry``: a fresh state as v0, then each a :func:`train_step` of
    the one before, published on it (its weights handed over); returns the states, oldest first."""
    states = [make_state(rng)]
    registry.publish(states[0], parent=None)
    for v in range(1, n):
        states.append(train_step(rng, states[-1]))
        registry.publish(states[v], parent=v - 1, parent_state=states[v - 1])
    return states


def assert_bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert state_sha256(got) == state_sha256(want)
    assert sorted(got) == sorted(want)
    for name in want:
        assert torch.equal(got[name].view(torch.uint8), want[name].view(torch.uint8)), name


# --- registry -----------------------------------------------------------------------------------


def test_publish_chain_and_load_every_version(sessions, store, rng: random.Random) -> None:
    registry = Registry(sessions, store, "line-a", full_every=3)
    states = [make_state(rng)]
    infos = [registry.publish(states[0], parent=None, train_step=0, metrics={"reward": 0.1})]
    for v in range(1, 8):
        states.append(train_step(rng, states[-1]))
        # Alternate: the caller hands over the parent's weights, or the registry loads them.
        parent_state = states[v - 1] if v % 2 else None
        infos.append(registry.publish(states[v], parent=v - 1, parent_state=parent_state, train_step=v * 10))

    assert [i.version for i in infos] == list(range(8))
    assert [i.kind for i in infos] == ["full", "delta", "delta", "full", "delta", "delta", "full", "delta"]
    assert [i.parent for i in infos] == [None, 0, 1, 2, 3, 4, 5, 6]
    for info, state in zip(infos, states, strict=True):
        assert info.sha256 == state_sha256(state)
        assert info.status == "candidate"
        assert store.exists(info.store_key) and info.store_key.startswith("line-a/")
        assert info.bytes == len(store.get(info.store_key))
        if info.kind == "delta":
            assert info.bytes < 0.2 * info.full_bytes
            assert info.fraction_changed == pytest.approx(0.03 * 23360 / 23424, rel=0.25)
        assert_bit_exact(registry.load(info.version), state)
        assert registry.get(info.version) == info
    assert infos[0].metrics == {"reward": 0.1} and infos[0].created_at.tzinfo is not None

    # Loading from a base the caller already has applies only the deltas after it.
    assert_bit_exact(registry.load(5, base=(4, states[4])), states[5])
    assert_bit_exact(registry.load(4, base=(4, states[4])), states[4])
    with pytest.raises(WeightsError, match="base state"):
        registry.load(5, base=(4, states[3]))
    assert_bit_exact(registry.load(2, base=(6, states[6])), states[2])  # base not on the chain: ignored

    assert registry.versions() == infos
    assert registry.latest() == infos[-1]
    assert [t["to_status"] for t in registry.transitions()] == ["candidate"] * 8
    with pytest.raises(VersionNotFound):
        registry.get(99)
    # Another line in the same database starts at 0 and sees none of line-a.
    other = Registry(sessions, store, "line-b")
    assert other.latest() is None and other.versions() == []
    assert other.publish(states[3], parent=None).version == 0


def test_statuses_and_audit_trail(sessions, store, rng: random.Random) -> None:
    registry = Registry(sessions, store, "line-s")
    s0 = make_state(rng)
    s1 = train_step(rng, s0)
    s2 = train_step(rng, s1)
    registry.publish(s0, parent=None)
    registry.publish(s1, parent=0, parent_state=s0)
    registry.publish(s2, parent=1, parent_state=s1)

    assert registry.set_status(0, "stable", "bootstrap").status == "stable"
    registry.set_status(1, "canary", "canary 10%")
    registry.set_status(1, "stable", "canary passed")
    assert registry.get(0).status == "retired"
    assert registry.latest("stable").version == 1
    registry.set_status(2, "canary", "canary 10%")
    registry.set_status(2, "rolled_back", "reward dropped")
    assert registry.latest("stable").version == 1
    assert registry.latest("candidate") is None
    assert registry.set_status(1, "stable", "again").status == "stable"  # no-op, not audited
    with pytest.raises(ValueError, match="unknown status"):
        registry.set_status(1, "golden", "nope")
    with pytest.raises(VersionNotFound):
        registry.set_status(7, "stable", "nope")

    trail = [(t["version"], t["from_status"], t["to_status"], t["reason"]) for t in registry.transitions()]
    assert trail == [
        (0, None, "candidate", "published (full)"),
        (1, None, "candidate", "published (delta)"),
        (2, None, "candidate", "published (delta)"),
        (0, "candidate", "stable", "bootstrap"),
        (1, "candidate", "canary", "canary 10%"),
        (0, "stable", "retired", "superseded by v1"),
        (1, "canary", "stable", "canary passed"),
        (2, "candidate", "canary", "canary 10%"),
        (2, "canary", "rolled_back", "reward dropped"),
    ]
    assert [t["to_status"] for t in registry.transitions(2)] == ["candidate", "canary", "rolled_back"]
    assert sum(1 for i in registry.versions() if i.status == "stable") == 1


def test_corrupt_or_missing_objects_fail_loudly(sessions, store, rng: random.Random) -> None:
    registry = Registry(sessions, store, "line-c", full_every=10)
    states = publish_chain(registry, rng, 4)

    key2 = registry.get(2).store_key
    data = bytearray(store.get(key2))
    data[len(data) // 2] ^= 0x10
    store.put(key2, bytes(data))
    assert_bit_exact(registry.load(1), states[1])  # before the damage: fine
    with pytest.raises(WeightsError, match="version 2"):
        registry.load(3)
    with pytest.raises(WeightsError, match="version 2"):
        registry.load(2)

    store.delete(registry.get(0).store_key)
    with pytest.raises(WeightsError, match="unavailable"):
        registry.load(1)

    # A full object swapped for another version's bytes is caught by the hash.
    registry2 = Registry(sessions, store, "line-c2")
    a, b = make_state(rng), make_state(rng)
    registry2.publish(a, parent=None)
    registry2.publish(b, parent=None)
    store.put(registry2.get(0).store_key, store.get(registry2.get(1).store_key))
    with pytest.raises(WeightsError, match="recorded hash"):
        registry2.load(0)


def test_publish_refuses_a_wrong_parent_state(sessions, store, rng: random.Random) -> None:
    registry = Registry(sessions, store, "line-p")
    s0 = make_state(rng)
    registry.publish(s0, parent=None)
    s1 = train_step(rng, s0)
    with pytest.raises(WeightsError, match="parent_state"):
        registry.publish(s1, parent=0, parent_state=train_step(rng, s0))
    with pytest.raises(VersionNotFound):
        registry.publish(s1, parent=5)
    assert [i.version for i in registry.versions()] == [0]
    assert len(store.list("line-p/")) == 1  # nothing left behind by the refused publishes

    forced = registry.publish(s1, parent=0, parent_state=s0, force_full=True)
    assert forced.kind == "full" and forced.parent == 0 and forced.fraction_changed is not None
    # A state with nothing in common with its parent is stored in full: the delta is not smaller.
    fresh = make_state(rng)
    assert registry.publish(fresh, parent=1, parent_state=s1).kind == "full"


class _StaleRegistry(Registry):
    """A publisher that read the version counter just before another one published."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.stale = True

    def _next_version(self) -> int:
        if self.stale:
            self.stale = False
            return super()._next_version() - 1
        return super()._next_version()


def test_version_numbers_are_never_reused(sessions, store, rng: random.Random) -> None:
    registry = Registry(sessions, store, "line-r")
    s0 = make_state(rng)
    registry.publish(s0, parent=None)
    racer = _StaleRegistry(sessions, store, "line-r")
    s1 = train_step(rng, s0)
    info = racer.publish(s1, parent=0, parent_state=s0)
    assert info.version == 1 and not racer.stale
    assert sorted(store.list("line-r/")) == sorted(i.store_key for i in registry.versions())
    assert_bit_exact(registry.load(0), s0)  # the loser's upload did not touch version 0's object

    # Real concurrent publishers (threads, one session each) get distinct numbers.
    results: list[int] = []
    errors: list[BaseException] = []
    states = {}

    def publisher(seed: int) -> None:
        local = Registry(sessions, store, "line-r")
        try:
            for _ in range(3):
                state = train_step(random.Random(seed), s1)
                info = local.publish(state, parent=1, parent_state=s1)
                states[info.version] = state
                results.append(info.version)
                seed += 1000
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=publisher, args=(rng.getrandbits(32),)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sorted(results) == list(range(2, 11))
    for version, state in states.items():
        assert_bit_exact(registry.load(version), state)


# --- the rollout pin -------------------------------------------------------------------------------


def _line(sessions, store, rng: random.Random, name: str, n: int,
          full: bool = False) -> tuple[Registry, list[dict[str, torch.Tensor]]]:
    """``n`` versions of ``name`` (deltas, or all ``full``): v0 stable, the others candidates."""
    registry = Registry(sessions, store, name)
    states = [make_state(rng)]
    registry.publish(states[0], parent=None)
    for v in range(1, n):
        states.append(train_step(rng, states[-1]))
        registry.publish(states[v], parent=v - 1, parent_state=states[v - 1], force_full=full)
    registry.set_status(0, "stable", "bootstrap")
    return registry, states


def test_a_pin_holds_its_version_stable_and_freezes_status_changes(sessions, store, rng: random.Random) -> None:
    woken: list[tuple[int, str]] = []
    registry, _ = _line(sessions, store, rng, "line-pin", 4)
    registry.announce = lambda info: woken.append((info.version, info.status))
    registry.set_status(1, "canary", "canary 10%")
    assert registry.pinned() is None

    pin, changed = registry.pin(2, by="alice@ops", reason="incident 42")
    assert (pin.model_line, pin.version, pin.by, pin.reason) == ("line-pin", 2, "alice@ops", "incident 42")
    assert registry.pinned() == pin
    # The canary went back to candidate (a pin is no verdict on it), v2 is stable, v0 retired.
    assert {i.version: i.status for i in registry.versions()} == {0: "retired", 1: "candidate", 2: "stable",
                                                                  3: "candidate"}
    assert [(i.version, i.status) for i in changed] == [(1, "candidate"), (2, "stable")]
    assert woken[-2:] == [(1, "candidate"), (2, "stable")]
    trail = [(t["version"], t["from_status"], t["to_status"], t["reason"]) for t in registry.transitions()][-3:]
    assert trail == [(1, "canary", "candidate", "canary ended: line pinned to v2 by alice@ops"),
                     (0, "stable", "retired", "superseded by v2 (pinned by alice@ops: incident 42)"),
                     (2, "candidate", "stable", "pinned by alice@ops: incident 42")]

    # Every status change is refused, compare-and-set or not; nothing moved.
    for version, status, expect in ((3, "stable", "candidate"), (3, "canary", None), (1, "rolled_back", None),
                                    (2, "retired", "stable")):
        with pytest.raises(LinePinned, match="pinned to v2 by alice@ops") as refused:
            registry.set_status(version, status, "controller", expect=expect)
        assert isinstance(refused.value, StatusChanged) and refused.value.pin == pin
    assert registry.set_status(2, "stable", "no-op").status == "stable"  # its own status again: a no-op
    # override_pin allows changes that leave the pinned version stable, and only those.
    assert registry.set_status(1, "rolled_back", "forced", override_pin=True).status == "rolled_back"
    for version, status in ((3, "stable"), (2, "retired")):
        with pytest.raises(LinePinned, match="move the pin"):
            registry.set_status(version, status, "forced", override_pin=True)
    assert registry.latest("stable").version == 2 and registry.pinned() == pin

    # Re-pinning moves the pin; pinning the stable version only records who/why.
    moved, changed = registry.pin(3, by="bob@ops", reason="hotfix")
    assert [(i.version, i.status) for i in changed] == [(3, "stable")]
    assert registry.get(2).status == "retired" and registry.pinned() == moved
    again, changed = registry.pin(3, by="carol@ops")
    assert changed == [] and (again.by, again.reason) == ("carol@ops", "")
    assert registry.transitions(3)[-1]["reason"] == "pinned by carol@ops"

    lifted = registry.unpin(by="dave@ops", reason="resolved")
    assert lifted == again and registry.pinned() is None and registry.unpin(by="dave@ops") is None
    assert registry.transitions(3)[-1] == {**registry.transitions(3)[-1], "from_status": "stable",
                                           "to_status": "stable",
                                           "reason": "unpinned by dave@ops: resolved (pinned by carol@ops)"}
    assert registry.set_status(0, "stable", "unfrozen").status == "stable"
    assert sum(1 for i in registry.versions() if i.status == "stable") == 1


def test_only_verifiable_versions_can_be_pinned(sessions, store, rng: random.Random) -> None:
    registry, _ = _line(sessions, store, rng, "line-pv", 3, full=True)
    with pytest.raises(VersionNotFound):
        registry.pin(9, by="x")
    key = registry.get(2).store_key
    data = bytearray(store.get(key))
    data[len(data) // 2] ^= 0x10
    store.put(key, bytes(data))
    with pytest.raises(WeightsError, match="version 2"):
        registry.pin(2, by="x")
    assert registry.pinned() is None and registry.get(2).status == "candidate"
    registry.set_status(1, "stable", "ok")
    collect(registry, keep_rollback=0)  # v0 (retired, nobody needs it) is collected
    assert registry.get(0).status == "collected"
    with pytest.raises(WeightsError, match="garbage-collected"):
        registry.pin(0, by="x")
    pin, _ = registry.pin(1, by="x")  # the stable one: no reload needed
    assert pin.version == 1
    assert 1 in needed(registry, keep_rollback=0)


def test_a_pin_survives_a_restart_and_the_database_keeps_one_per_line(migrated_db_url, store, rng) -> None:
    from sqlalchemy import update
    from sqlalchemy.exc import IntegrityError

    from flywheel.db.models import ModelVersion
    from flywheel.db.session import make_engine, make_session_factory

    engine = make_engine(migrated_db_url)
    registry, _ = _line(make_session_factory(engine), store, rng, "line-pr", 3)
    pin, _ = registry.pin(1, by="alice@ops", reason="freeze")
    engine.dispose()  # the process is gone

    engine = make_engine(migrated_db_url)
    try:
        sessions = make_session_factory(engine)
        again = Registry(sessions, store, "line-pr")
        assert again.pinned() == pin and again.latest("stable").version == 1
        with pytest.raises(LinePinned):
            again.set_status(2, "stable", "after the restart")
        with pytest.raises(IntegrityError):  # a second pinned row on the line: refused by the database itself
            with sessions() as db, db.begin():
                db.execute(update(ModelVersion).where(ModelVersion.model_line == "line-pr", ModelVersion.version == 2)
                           .values(pinned_at=pin.at, pinned_by="mallory"))
        assert Registry(sessions, store, "line-other").pinned() is None  # pins are per line
    finally:
        engine.dispose()


def test_pins_and_compare_and_set_promotions_never_interleave(sessions, store, rng: random.Random) -> None:
    """Threads pinning, unpinning and promoting by compare-and-set at once: afterwards (and after
    every operation) the line has one stable version, the pinned one when pinned."""
    registry, _ = _line(sessions, store, rng, "line-pc", 6)
    errors: list[BaseException] = []
    seeds = [rng.getrandbits(32) for _ in range(4)]

    def worker(seed: int) -> None:
        local, r = Registry(sessions, store, "line-pc"), random.Random(seed)
        try:
            for _ in range(12):
                op, version = r.choice(["pin", "unpin", "promote", "promote"]), r.randrange(6)
                if op == "pin":
                    local.pin(version, by=f"w{seed}")
                elif op == "unpin":
                    local.unpin(by=f"w{seed}")
                else:
                    info = local.get(version)
                    try:
                        local.set_status(version, "stable", "cas", expect=info.status)
                    except StatusChanged:
                        pass  # pinned, or moved meanwhile: refused as designed
                versions = local.versions()
                assert sum(1 for i in versions if i.status == "stable") == 1, versions
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    pin = registry.pinned()
    stable = registry.latest("stable")
    assert stable is not None and (pin is None or pin.version == stable.version)
    pinned_rows = [t for t in registry.transitions() if t["reason"].startswith("pinned by")]
    assert pinned_rows, "the workers never pinned: the test proves nothing"


# --- store --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key",
    ["../x", "/etc/passwd", "a/../../x", "a/./b", "a\\b", "a\x00b", "", "a//b", "a/", ".hidden", "a/..", "sp ace", "é"],
)
def test_store_rejects_unsafe_keys(store: FolderStore, key: str) -> None:
    with pytest.raises(InvalidKey):
        store.put(key, b"x")
    with pytest.raises(InvalidKey):
        store.get(key)
    with pytest.raises(InvalidKey):
        store.exists(key)
    with pytest.raises(InvalidKey):
        store.delete(key)
    assert not (store.root.parent / "x").exists()


def test_store_rejects_symlink_escape(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"s3cret")
    store = FolderStore(tmp_path / "root")
    store.put("ok/a", b"1")
    os.symlink(outside, store.root / "link")
    with pytest.raises(InvalidKey, match="outside"):
        store.get("link/secret")
    with pytest.raises(InvalidKey, match="outside"):
        store.put("link/new", b"x")
    assert not (outside / "new").exists()
    with pytest.raises(InvalidKey):
        Registry(None, store, "../evil")  # type: ignore[arg-type]


def test_store_put_is_atomic_and_listable(store: FolderStore) -> None:
    store.put("m/v1.full", b"one")
    store.put("m/v1.full", b"uno")  # replace
    store.put("m/v2.delta", b"two")
    store.put("n/v1.full", b"")
    assert store.get("m/v1.full") == b"uno" and store.get("n/v1.full") == b""
    assert store.list() == ["m/v1.full", "m/v2.delta", "n/v1.full"]
    assert store.list("m/") == ["m/v1.full", "m/v2.delta"]
    assert not [p for p in store.root.rglob("*") if p.name.startswith(".")]  # no temp files left
    store.delete("m/v2.delta")
    store.delete("m/v2.delta")  # idempotent
    assert not store.exists("m/v2.delta")
    with pytest.raises(ObjectNotFound):
        store.get("m/v2.delta")
    with pytest.raises(ObjectNotFound):
        store.get("m")  # a folder is not an object


def test_make_store_follows_settings(tmp_path: Path) -> None:
    settings = load_settings(data_dir=str(tmp_path))
    store = make_store(settings)
    assert isinstance(store, FolderStore) and store.root == tmp_path / "weights"
    s3 = make_store(load_settings(data_dir=str(tmp_path), store={"kind": "s3", "bucket": "b", "prefix": "p/"}))
    assert isinstance(s3, S3Store) and (s3.bucket, s3.prefix) == ("b", "p/")  # no request until used
