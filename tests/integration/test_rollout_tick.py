"""The rollout controller's IO step against a real registry: promote, retire, announce."""

import pytest
import torch

from flywheel.db.session import make_engine, make_session_factory
from flywheel.events import VersionEvent
from flywheel.weights.registry import Registry
from flywheel.weights.store import FolderStore
from serving.rollout import tick

pytestmark = pytest.mark.integration


def test_tick_promotes_the_newest_candidate_and_announces_it(migrated_db_url, tmp_path):
    registry = Registry(make_session_factory(make_engine(migrated_db_url)), FolderStore(tmp_path), "line")
    base = {"w": torch.randn(64, 64).to(torch.bfloat16)}
    registry.ensure_base(base, reason="test")
    nxt = {"w": base["w"].clone()}
    nxt["w"][0, :3] += 1
    v1 = registry.publish(nxt, parent=0, parent_state=base)
    v2 = registry.publish(nxt, parent=v1.version, parent_state=nxt)
    events: list[VersionEvent] = []

    assert tick(registry, events.append) == v2.version
    assert [v.status for v in registry.versions()] == ["retired", "candidate", "stable"]
    (event,) = events
    assert VersionEvent.from_bytes(event.to_bytes()) == event
    assert (event.version, event.status, event.sha256, event.session_id) == (v2.version, "stable", v2.sha256, "line")
    assert tick(registry, events.append) is None and len(events) == 1  # nothing newer: no decision
