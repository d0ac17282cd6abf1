"""Which version each trajectory was trained into (``trained_trajectories``), on SQLite and PostgreSQL:
written by the registry's publish with the version's row, and backfilled by migration 0007 from
the ``trajectory_ids`` of versions published before it."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from flywheel.db.models import TrainedTrajectory
from flywheel.db.session import downgrade, make_engine, make_session_factory, upgrade
from flywheel.db.trained import trained_in, trained_into
from flywheel.weights.registry import Registry
from flywheel.weights.store import FolderStore
from tests.integration.test_registry import make_state, train_step

pytestmark = pytest.mark.integration


class RacedRegistry(Registry):
    """A publisher whose first try takes a version number another publisher already has."""

    raced = False

    def _next_version(self) -> int:
        if not self.raced:
            self.raced = True
            return super()._next_version() - 1
        return super()._next_version()


def test_publish_records_the_trained_trajectories_with_the_version(sessions, tmp_path: Path,
                                                                   rng: random.Random) -> None:
    store = FolderStore(tmp_path / "store")
    registry = Registry(sessions, store, "line-t")
    s0 = make_state(rng)
    v0 = registry.publish(s0, parent=None, metrics={"base": "test"})
    s1 = train_step(rng, s0)
    v1 = registry.publish(s1, parent=0, parent_state=s0, metrics={"loss": 0.5, "trajectory_ids": ["a", "b", "a"]})
    with sessions() as session:
        assert trained_in(session, "line-t", v1.version) == ["a", "b"]
        assert trained_in(session, "line-t", v0.version) == []
        assert trained_into(session, ["a", "b", "zz"]) == {"a": ("line-t", 1), "b": ("line-t", 1)}
        row = session.get(TrainedTrajectory, "a")
        assert row is not None and row.trained_at == v1.created_at

    # An id trained again (against the at-most-once rule) does not fail the publish; the first
    # version keeps it, and the metrics still say what the trainer said.
    s2 = train_step(rng, s1)
    v2 = registry.publish(s2, parent=1, parent_state=s1, metrics={"trajectory_ids": ["b", "c"]})
    assert v2.metrics["trajectory_ids"] == ["b", "c"]
    with sessions() as session:
        assert trained_into(session, ["a", "b", "c"]) == {"a": ("line-t", 1), "b": ("line-t", 1), "c": ("line-t", 2)}

    # A publisher that loses the race for a number records its ids under the number it gets.
    s3 = train_step(rng, s2)
    v3 = RacedRegistry(sessions, store, "line-t").publish(s3, parent=2, parent_state=s2,
                                                           metrics={"trajectory_ids": ["d"]})
    assert v3.version == 3
    with sessions() as session:
        assert trained_into(session, ["d"]) == {"d": ("line-t", 3)}
        assert trained_in(session, "line-t", 2) == ["c"]

    # Ids that cannot be recorded are refused before anything is uploaded.
    keys = store.list()
    for bad in ("a", ["ok", 7], ["x" * 129], [""]):
        with pytest.raises(ValueError, match="trajectory_ids"):
            registry.publish(train_step(rng, s3), parent=3, parent_state=s3, metrics={"trajectory_ids": bad})
    assert store.list() == keys and registry.latest().version == 3


def test_migration_0007_backfills_trained_trajectories(db_url: str) -> None:
    upgrade(db_url, "0006")
    versions = sa.table(
        "model_versions", *(sa.column(c) for c in ("model_line", "version", "kind", "parent", "sha256", "store_key",
                                                   "bytes", "full_bytes", "status")),
        sa.column("metrics", sa.JSON()), sa.column("created_at", sa.DateTime(timezone=True)))
    start = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)
    listed = {
        ("line-a", 0): {"trajectory_ids": ["t1", "t2"]},
        ("line-a", 1): {"trajectory_ids": ["t3", "t1"], "loss": 0.1},  # t1 again: v0 keeps it
        ("line-a", 2): {"loss": 0.2},
        ("line-a", 3): {"trajectory_ids": "not-a-list"},
        ("line-b", 0): {"trajectory_ids": ["t4", 5, "x" * 129, ""]},
        # More versions than one chunk of the backfill holds (500), one id each.
        **{("line-many", v): {"trajectory_ids": [f"m{v}"]} for v in range(1203)},
    }
    rows = [{"model_line": line, "version": v, "kind": "full", "parent": None, "sha256": "0" * 64,
             "store_key": f"{line}/v{v}", "bytes": 1, "full_bytes": 1, "status": "candidate", "metrics": metrics,
             "created_at": start + timedelta(seconds=i)} for i, ((line, v), metrics) in enumerate(listed.items())]
    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(versions.insert(), rows)
        upgrade(db_url, "0007")
        with make_session_factory(engine)() as session:
            got = {r.trajectory_id: (r.model_line, r.version, r.trained_at) for r in session.scalars(
                sa.select(TrainedTrajectory))}
        when = {(r["model_line"], r["version"]): r["created_at"] for r in rows}
        want = {"t1": ("line-a", 0), "t2": ("line-a", 0), "t3": ("line-a", 1), "t4": ("line-b", 0),
                **{f"m{v}": ("line-many", v) for v in range(1203)}}
        assert got == {tid: (*key, when[key]) for tid, key in want.items()}

        downgrade(db_url, "0006")
        assert "trained_trajectories" not in sa.inspect(engine).get_table_names()
        assert "ix_sessions_session_id" not in {i["name"] for i in sa.inspect(engine).get_indexes("sessions")}
    finally:
        engine.dispose()
