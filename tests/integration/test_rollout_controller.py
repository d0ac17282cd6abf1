"""The rollout controller on a real database (SQLite and PostgreSQL): gates, canary, promote, roll back.

A registry with a stable version 0 and candidates published on top (tiny states, folder store);
the canary's evidence is real ``generations`` and ``feedback`` rows, inserted as ingest stores them
(the payload is the event's JSON with ``latency_ms`` and ``finish_reason``), and real
``reward_version_stats`` rows for the held-out gate.
"""

from __future__ import annotations

import random
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from flywheel.cli import build_parser, dispatch
from flywheel.db.models import Feedback, Generation, RewardSpecRow, RewardVersionStats
from flywheel.events import VersionEvent
from flywheel.settings import RolloutSettings, load_settings
from flywheel.weights.registry import Registry
from flywheel.weights.store import FolderStore
from serving.rollout import manual_promote, manual_rollback, RolloutError, step
from tests.integration.test_registry import make_state, train_step

pytestmark = pytest.mark.integration

LINE = "roll-line"
POLICY = RolloutSettings(canary_fraction=0.5, window_s=0, min_samples=100, alpha=0.05, held_out_min_samples=50,
                         held_out_tolerance=0.02, parity_max=0.05)


@pytest.fixture
def registry(sessions, tmp_path: Path) -> Registry:
    reg = Registry(sessions, FolderStore(tmp_path / "store"), LINE)
    rng = random.Random(7)
    state = make_state(rng)
    reg.ensure_base(state, reason="test base")
    reg.rng, reg.state = rng, state  # type: ignore[attr-defined]
    return reg


def publish(registry: Registry, metrics: dict | None = None) -> int:
    nxt = train_step(registry.rng, registry.state)  # type: ignore[attr-defined]
    info = registry.publish(nxt, parent=registry.latest().version, metrics=metrics or {})
    registry.state = nxt  # type: ignore[attr-defined]
    return info.version


def serve(sessions, version: int, n: int, *, thumbs_down: int = 0, retries: int = 0, errors: int = 0,
          latency_ms: float = 100.0) -> None:
    """``n`` generations served by ``version`` now; the first ones get the negative feedback."""
    now = datetime.now(UTC)
    with sessions() as db, db.begin():
        for i in range(n):
            gid = uuid.uuid4().hex
            session_id = f"s-{gid[:8]}"
            db.add(Generation(
                event_id=gid, generation_id=gid, tenant="acme", session_id=session_id, model_line=LINE,
                model_version=version, node_id="n1", ts=now,
                payload={"generation_id": gid, "model_version": version, "latency_ms": latency_ms + i % 13,
                         "finish_reason": "error" if i < errors else "stop"},
            ))
            signal = "thumbs" if i < thumbs_down else "retry" if i < thumbs_down + retries else None
            if signal is not None:
                fid = uuid.uuid4().hex
                db.add(Feedback(event_id=fid, feedback_id=fid, tenant="acme", session_id=session_id, generation_id=gid,
                                kind="explicit" if signal == "thumbs" else "implicit", signal=signal,
                                value=-1.0 if signal == "thumbs" else None, ts=now, state="pending", payload={}))
            if i % 10 == 0:  # positive feedback is not negative
                fid = uuid.uuid4().hex
                db.add(Feedback(event_id=fid, feedback_id=fid, tenant="acme", session_id=session_id, generation_id=gid,
                                kind="explicit", signal="thumbs", value=1.0, ts=now, state="pending", payload={}))


def held_out(sessions, version: int, count: int, total: float, spec: str = "spec-1") -> None:
    now = datetime.now(UTC)
    with sessions() as db, db.begin():
        if db.get(RewardSpecRow, spec) is None:
            db.add(RewardSpecRow(version=spec, sha256="0" * 64, spec={}, created_at=now))
        db.add(RewardVersionStats(model_line=LINE, model_version=version, reward_spec_version=spec, train_count=count,
                                  train_sum=total, held_out_count=count, held_out_sum=total, flagged=False,
                                  flag_reason="", updated_at=now))


def statuses(registry: Registry) -> dict[int, str]:
    return {v.version: v.status for v in registry.versions()}


def test_a_candidate_becomes_canary_and_is_promoted_when_equal(registry, sessions):
    v1 = publish(registry)
    events: list[VersionEvent] = []
    d = step(registry, sessions, POLICY, events.append)
    assert (d.action, d.version) == ("canary", v1)
    assert statuses(registry) == {0: "stable", v1: "canary"}
    assert [(e.version, e.status) for e in events] == [(v1, "canary")]
    assert "canary 50% vs v0" in registry.transitions(v1)[-1]["reason"]

    serve(sessions, 0, 300, thumbs_down=15, errors=1)
    serve(sessions, v1, 150, thumbs_down=7, retries=1)
    d = step(registry, sessions, POLICY, events.append)
    assert (d.action, d.version) == ("promote", v1), d.reason
    assert statuses(registry) == {0: "retired", v1: "stable"}
    reason = registry.transitions(v1)[-1]["reason"]
    assert "neg 8/150 vs 15/300" in reason and "err 0/150 vs 1/300" in reason and "latency median" in reason
    assert d.figures["canary"]["generations"] == 150 and d.figures["stable"]["negative"] == 15
    assert [(e.version, e.status) for e in events][-1] == (v1, "stable")
    assert step(registry, sessions, POLICY).action == "none"  # nothing newer


def test_a_canary_with_clearly_more_thumbs_down_is_rolled_back(registry, sessions):
    v1 = publish(registry)
    assert step(registry, sessions, POLICY).action == "canary"
    serve(sessions, 0, 200, thumbs_down=10)
    serve(sessions, v1, 200, thumbs_down=50)
    d = step(registry, sessions, POLICY.model_copy(update={"window_s": 3600}))  # rolls back inside the window
    assert (d.action, d.version) == ("rollback", v1)
    assert statuses(registry) == {0: "stable", v1: "rolled_back"}
    reason = registry.transitions(v1)[-1]["reason"]
    assert "worse negative feedback" in reason and "neg 50/200 vs 10/200" in reason
    # The rolled-back version is never picked again; the next candidate gets the next canary.
    v2 = publish(registry)
    assert (step(registry, sessions, POLICY).action, statuses(registry)[v2]) == ("canary", "canary")


def test_the_canary_waits_below_min_samples_and_inside_the_window(registry, sessions):
    v1 = publish(registry)
    step(registry, sessions, POLICY)
    serve(sessions, 0, 500, thumbs_down=100)  # 20%
    serve(sessions, v1, 60, thumbs_down=30)  # 50%: terrible, but too few to judge
    d = step(registry, sessions, POLICY)
    assert d.action == "wait" and "samples canary 60" in d.reason and "min_samples 100" in d.reason
    serve(sessions, v1, 60)  # 30/120 = 25% vs 20%: z = 1.2, p = 0.11, not worse at 0.05
    windowed = POLICY.model_copy(update={"window_s": 3600})
    d = step(registry, sessions, windowed)
    assert d.action == "wait" and "window" in d.reason
    assert step(registry, sessions, windowed, now=datetime.now(UTC) + timedelta(hours=2)).action == "promote"
    assert statuses(registry)[v1] == "stable"


def test_gates_block_a_bad_held_out_rate_or_parity_figure(registry, sessions):
    v1 = publish(registry, {"parity": 0.001})  # no held-out samples yet: passes, says so
    v2 = publish(registry, {"parity": 0.2})  # parity over the threshold
    v3 = publish(registry, {"parity": 0.001})  # held-out rate well below stable's
    held_out(sessions, 0, 200, 120.0)  # stable 0.60
    held_out(sessions, v3, 200, 90.0)  # 0.45
    d = step(registry, sessions, POLICY)
    assert (d.action, d.version) == ("canary", v1), d.reason
    assert "too few samples" in d.reason and "parity=0.001" in d.reason
    assert "parity=0.2 >= 0.05" in d.figures["blocked"][v2]
    assert "below stable" in d.figures["blocked"][v3] and "0.4500" in d.figures["blocked"][v3]
    assert statuses(registry) == {0: "stable", v1: "canary", v2: "candidate", v3: "candidate"}


def test_a_canary_whose_held_out_rate_drops_is_rolled_back(registry, sessions):
    v1 = publish(registry)
    step(registry, sessions, POLICY)
    held_out(sessions, 0, 200, 120.0)
    held_out(sessions, v1, 60, 24.0)  # 0.40 vs 0.60, now that the canary served held-out sessions
    d = step(registry, sessions, POLICY)
    assert (d.action, d.version) == ("rollback", v1) and "held-out" in d.reason


def test_canary_fraction_zero_promotes_directly(registry, sessions):
    v1 = publish(registry)
    d = step(registry, sessions, POLICY.model_copy(update={"canary_fraction": 0.0}))
    assert (d.action, d.version) == ("promote", v1) and "canary_fraction 0" in d.reason
    assert statuses(registry) == {0: "retired", v1: "stable"}


def test_manual_promote_and_rollback(registry, sessions):
    v1, v2 = publish(registry), publish(registry)
    manual_promote(registry, v1)
    manual_promote(registry, v2)
    assert statuses(registry) == {0: "retired", v1: "retired", v2: "stable"}
    assert manual_rollback(registry, v2, "bad answers") == [v1, v2]
    assert statuses(registry) == {0: "retired", v1: "stable", v2: "rolled_back"}
    assert "bad answers" in registry.transitions(v2)[-1]["reason"]
    assert manual_rollback(registry, v1) == [0, v1]  # v2 is rolled back: the next one down is v0
    with pytest.raises(RolloutError, match="no earlier stable"):
        manual_rollback(registry, 0)
    with pytest.raises(RolloutError, match="only a canary or the stable"):
        manual_rollback(registry, v2)
    v3 = publish(registry)
    step(registry, sessions, POLICY)
    assert manual_rollback(registry, v3) == [v3] and statuses(registry)[v3] == "rolled_back"


def test_the_cli_commands(registry, sessions, migrated_db_url, tmp_path, capsys):
    settings = load_settings(data_dir=str(tmp_path / "data"), db={"url": migrated_db_url}, model={"line": LINE},
                             store={"path": str(tmp_path / "store")}, bus={"topic_prefix": f"t{uuid.uuid4().hex[:8]}."},
                             rollout=POLICY.model_dump())
    v1 = publish(registry)
    parser = build_parser()
    assert dispatch(parser.parse_args(["rollout", "status"]), settings) == 0
    out = capsys.readouterr().out
    assert f"v{v1}" in out and "next decision: canary" in out
    assert dispatch(parser.parse_args(["rollout", "promote", str(v1), "--reason", "ship it"]), settings) == 0
    assert statuses(registry)[v1] == "stable"
    assert dispatch(parser.parse_args(["rollout", "rollback", str(v1)]), settings) == 0
    assert statuses(registry) == {0: "stable", v1: "rolled_back"}
    assert dispatch(parser.parse_args(["rollout", "rollback", str(v1)]), settings) == 1
    assert dispatch(parser.parse_args(["rollout", "promote"]), settings) == 2
    assert parser.parse_args(["rollout"]).action is None  # no action: the controller loop
