"""``flywheel chaos``'s quick subset on the real stack, and its checker catching broken invariants.

One :class:`chaos.run.ChaosRun` for the module: a private PostgreSQL cluster, Redis and a Tansu broker
in memory, with the quick tiny model. One scenario runs for real on a fleet of nine role processes
(gateway, two nodes behind fault-injecting proxies, two ingest and two rewards workers, trainer,
rollout controller) under simulated users: ``kill9``, one process of every role type killed with
SIGKILL at a random moment and restarted. The other scenarios are ``flywheel chaos``'s (the README
has the latest full run); one more here would add about 40 s to a suite kept under 15 minutes.

The gateway runs with ``auth = "on"``: the users send tenant keys, the harness an admin key.
Every invariant must hold. ``rollout_safe`` must flag a generation of a version served
before it was made canary or stable. Then the database of the ``kill9`` run is broken on purpose,
one way at a time (one trajectory listed as trained by two versions, a received generation
deleted, a second trajectory for one session), and the checker must flag the invariant each break
violates, counting the duplicate or the loss.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import delete, insert, select

from chaos.invariants import InvariantResult, check_rollout
from chaos.report import format_details
from chaos.run import ChaosRun, Outcome, recheck
from flywheel.db.models import Generation, ModelVersion, Trajectory
from flywheel.db.session import make_engine
from flywheel.settings import load_settings
from testbed.procs import ServiceUnavailable

pytestmark = pytest.mark.integration

SECONDS = 15.0  # traffic (and fault) window per scenario


@pytest.fixture(scope="module")
def chaos_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChaosRun]:
    root = tmp_path_factory.mktemp("chaos")
    run = ChaosRun(load_settings(None, data_dir=str(root)), root, model_path=tiny_model_dir)
    try:
        run.__enter__()
    except ServiceUnavailable as exc:
        pytest.fail(f"the chaos suite cannot start its services: {exc}", pytrace=False)
    try:
        yield run
    finally:
        run.__exit__(None, None, None)


@pytest.fixture(scope="module")
def kill9(chaos_run: ChaosRun) -> Outcome:
    return chaos_run.scenario("kill9", SECONDS, users=4, seed=1)


def by_name(results: list[InvariantResult]) -> dict[str, InvariantResult]:
    return {r.name: r for r in results}


def test_kill9_every_role_type_keeps_every_invariant(kill9: Outcome) -> None:
    result = kill9.result
    print(format_details([result]))
    assert result.invariants_ok, format_details([result])
    assert result.events > 0 and result.lost == 0 and result.duplicated == 0
    killed = {exit["name"].split("-")[0] for exit in result.figures["exits"] if exit["how"] == "kill"}
    assert killed == {"gateway", "node", "ingest", "rewards", "trainer", "rollout"}, result.faults
    assert kill9.snapshot is not None
    assert [e.ok for e in kill9.snapshot.expectations if e.name.startswith("auth on")] == [True]
    # No poison in kill9, and no good record dead-lettered (every dead-letter topic read, none exists).
    assert by_name(result.invariants)["poison_dead_lettered"].detail == "no poison produced, nothing dead-lettered"


def test_rollout_safe_flags_a_version_served_before_it_was_canary_or_stable(kill9: Outcome) -> None:
    s = kill9.snapshot
    assert s is not None and check_rollout(s).ok
    version = max(g.model_version for g in s.generations)
    first = min(g.ts for g in s.generations if g.model_version == version and g.ts is not None)
    late = replace(s, promoted_at={**s.promoted_at, version: first + timedelta(milliseconds=1)})
    assert not check_rollout(late).ok and f"{version}:" in check_rollout(late).detail
    never = replace(s, promoted_at={v: at for v, at in s.promoted_at.items() if v != version})
    assert not check_rollout(never).ok


def test_the_checker_flags_broken_invariants(kill9: Outcome) -> None:
    assert kill9.snapshot is not None
    assert all(r.ok for r in recheck(kill9)), "re-reading an untouched database must change nothing"
    engine = make_engine(kill9.database_url)
    try:
        with engine.begin() as conn:
            # 1. One trajectory in the trajectory_ids of two versions (a sample trained twice).
            versions = conn.execute(select(ModelVersion).order_by(ModelVersion.version)).all()
            top = versions[-1]
            trained = {tid for v in kill9.snapshot.versions for tid in v.trajectory_ids}
            trainable = [r.trajectory_id for r in kill9.snapshot.scored if not r.payload.get("held_out")]
            untrained = [tid for tid in trainable if tid not in trained]
            # An untrained sample goes into two new versions; when the run trained every one, a
            # trained sample goes into one (either way one trajectory is trained twice).
            sample, numbers = (untrained[0], (1, 2)) if untrained else (next(t for t in trainable if t in trained), (1,))
            for number in numbers:
                conn.execute(insert(ModelVersion).values(
                    model_line=top.model_line, version=top.version + number, kind="full", parent=top.version + number - 1,
                    sha256=top.sha256, store_key=top.store_key, bytes=top.bytes, full_bytes=top.full_bytes,
                    metrics={"trajectory_ids": [sample], "publish_token": uuid.uuid4().hex},
                    status="candidate", created_at=datetime.now(UTC)))
        flagged = by_name(recheck(kill9))
        assert not flagged["trainer_exactly_once"].ok and flagged["trainer_exactly_once"].duplicated == 1
        assert [r.name for r in flagged.values() if not r.ok] == ["trainer_exactly_once"]

        # 2. A generation a client received, gone from the database.
        received = next(iter(kill9.snapshot.client.received))
        with engine.begin() as conn:
            conn.execute(delete(Generation).where(Generation.generation_id == received))
        flagged = by_name(recheck(kill9))
        assert not flagged["captured"].ok and flagged["captured"].lost == 1, flagged["captured"].detail

        # 3. A second trajectory for one session (another id, the same turns).
        with engine.begin() as conn:
            row = conn.execute(select(Trajectory).limit(1)).first()
            conn.execute(insert(Trajectory).values(
                trajectory_id=uuid.uuid4().hex, revision=0, event_id=uuid.uuid4().hex, tenant=row.tenant,
                session_id=row.session_id, model_line=row.model_line, closed_reason=row.closed_reason, ts=row.ts,
                payload=row.payload))
        flagged = by_name(recheck(kill9))
        trajectories = flagged["trajectories_unique"]
        assert not trajectories.ok and trajectories.duplicated >= 1, trajectories.detail
    finally:
        engine.dispose()
