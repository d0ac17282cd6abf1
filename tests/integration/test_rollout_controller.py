"""The rollout controller on a real database (SQLite and PostgreSQL): gates, canary, promote, roll back.

A registry with a stable version 0 and candidates published on top (tiny states, folder store);
the canary's evidence is real ``generations`` and ``feedback`` rows, inserted as ingest stores them
(the payload is the event's JSON with ``latency_ms`` and ``finish_reason``), and real
``reward_version_stats`` rows for the held-out gate.
"""

from __future__ import annotations

import json
import random
import uuid
from datetime import UTC, datetime, time, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from flywheel.db.models import Feedback, Generation, Node, RewardSpecRow, RewardVersionStats
from flywheel.events import VersionEvent
from flywheel.settings import RolloutSettings, load_settings
from flywheel.weights.registry import Registry
from flywheel.weights.store import FolderStore
from launch.cli import build_parser, dispatch
from serving.rollout import NODE_FRESH_S, step, tick
from serving.rollout_actions import (
    Pinned,
    RolloutError,
    VerificationFailed,
    manual_clear,
    manual_pin,
    manual_promote,
    manual_rollback,
    manual_unpin,
)
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


def report(sessions, node_id: str, live: int | None, status: str, detail: str, age_s: float = 0.0) -> None:
    """A node's database heartbeat, as ``serving.node.updater`` writes it."""
    with sessions() as db, db.begin():
        db.merge(Node(node_id=node_id, region="eu", url=f"http://{node_id}", model_line=LINE, live_version=live,
                      status=status, detail=detail, last_heartbeat=datetime.now(UTC) - timedelta(seconds=age_s)))


def test_a_stable_version_no_node_can_load_is_rolled_back_and_the_previous_one_restored(registry, sessions):
    v1, v2 = publish(registry), publish(registry)
    direct = POLICY.model_copy(update={"canary_fraction": 0.0})
    assert step(registry, sessions, direct).version == v2 and statuses(registry)[v2] == "stable"
    failed = f"version {v2}: WeightsError: delta v{v2} rebuilds to 0a1b2c3d4e5f, expected 9f8e7d6c5b4a"
    report(sessions, "node-a", 0, "failed_update", failed)
    report(sessions, "node-b", 0, "updating", f"loading version {v2}")
    report(sessions, "node-gone", 0, "serving", "", age_s=NODE_FRESH_S + 5)  # stale: no say
    assert step(registry, sessions, direct).action == "none"  # node-b may still load it
    report(sessions, "node-b", v2, "serving", f"updated 0 -> {v2}")
    assert step(registry, sessions, direct).action == "none"  # one node serves it
    report(sessions, "node-b", 0, "failed_update", failed)
    events: list[VersionEvent] = []
    d = step(registry, sessions, direct, events.append)
    assert (d.action, d.version, d.was) == ("rollback", v2, "stable")
    assert "node-a: WeightsError" in d.reason and "node-b: WeightsError" in d.reason
    # v0 was the last stable; v1, skipped on the way to v2, is on v2's chain: implicated too.
    assert statuses(registry) == {0: "stable", v1: "rolled_back", v2: "rolled_back"}
    assert [(e.version, e.status) for e in events] == [(v1, "rolled_back"), (0, "stable"), (v2, "rolled_back")]
    assert "failed load: no node can load stable" in registry.transitions(v2)[-1]["reason"]
    assert f"the chain of stable v{v2} runs through v{v1}" in registry.transitions(v1)[-1]["reason"]
    # The nodes serve v0 again: nothing more to undo; the next version published is the next candidate.
    report(sessions, "node-a", 0, "serving", "")
    assert step(registry, sessions, direct).action == "none"
    v3 = publish(registry)
    assert (step(registry, sessions, direct).action, statuses(registry)[v3]) == ("promote", "stable")


def test_a_canary_no_node_can_load_is_rolled_back_without_waiting_for_samples(registry, sessions):
    v1 = publish(registry)
    assert step(registry, sessions, POLICY).action == "canary"
    report(sessions, "node-a", 0, "failed_update", f"version {v1}: WeightsError: truncated delta")
    report(sessions, "node-b", 0, "failed_update", f"version {v1 + 7}: WeightsError: another version")
    assert step(registry, sessions, POLICY).action == "wait"  # node-b failed on something else
    report(sessions, "node-b", 0, "failed_update", f"version {v1}: WeightsError: truncated delta")
    d = step(registry, sessions, POLICY)
    assert (d.action, d.was) == ("rollback", "canary") and statuses(registry) == {0: "stable", v1: "rolled_back"}


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


# --- pinned lines -----------------------------------------------------------------------------------


def test_a_pinned_line_neither_canaries_nor_promotes_a_passing_candidate_until_unpinned(registry, sessions):
    v1 = publish(registry, {"parity": 0.001})
    pin, changed = manual_pin(registry, 0, "alice@ops", "release freeze")
    assert changed == [] and registry.pinned() == pin  # v0 was stable already: only frozen
    for policy in (POLICY, POLICY.model_copy(update={"canary_fraction": 0.0})):
        d = step(registry, sessions, policy)
        assert (d.action, d.version, d.changed) == ("pinned", 0, False)
        assert "pinned to v0 by alice@ops" in d.reason and "release freeze" in d.reason and f"v{v1}" in d.reason
        assert d.figures["held"] == [v1]
    assert tick(registry, rollout=POLICY) is None and tick(registry) is None
    assert statuses(registry) == {0: "stable", v1: "candidate"}

    lifted = manual_unpin(registry, "bob@ops", "freeze over")
    assert lifted == pin and registry.pinned() is None
    d = step(registry, sessions, POLICY)
    assert (d.action, d.version) == ("canary", v1)  # resumes where it would have been
    with pytest.raises(RolloutError, match="not pinned"):
        manual_unpin(registry, "bob@ops")


def test_pinning_ends_a_running_canary_and_unpinning_starts_a_fresh_one(registry, sessions):
    v1 = publish(registry)
    assert step(registry, sessions, POLICY).action == "canary"
    serve(sessions, 0, 300)
    serve(sessions, v1, 300)  # enough, and equal: the next tick would promote
    _, changed = manual_pin(registry, 0, "alice@ops", "incident 7")
    assert changed == [v1] and statuses(registry) == {0: "stable", v1: "candidate"}
    assert registry.transitions(v1)[-1]["reason"] == "canary ended: line pinned to v0 by alice@ops"
    assert step(registry, sessions, POLICY).action == "pinned"
    assert statuses(registry) == {0: "stable", v1: "candidate"}

    manual_unpin(registry, "alice@ops")
    assert step(registry, sessions, POLICY).action == "canary"
    d = step(registry, sessions, POLICY)  # a new window: the old canary's generations predate it
    assert d.action == "wait" and "samples canary 0" in d.reason


def test_pinning_another_version_makes_it_stable_and_the_pin_follows_forced_actions(registry, sessions):
    v1, v2, v3 = publish(registry), publish(registry), publish(registry)
    manual_promote(registry, v2)
    pin, changed = manual_pin(registry, v1, "alice@ops", "v2 misbehaves")  # back to an older, never-stable one
    assert changed == [v1] and statuses(registry) == {0: "retired", v1: "stable", v2: "retired", v3: "candidate"}
    assert step(registry, sessions, POLICY).action == "pinned"  # v3 is newer than stable: held back

    with pytest.raises(Pinned, match=f"pinned to v{v1} by alice@ops .*v2 misbehaves.*promote is refused"):
        manual_promote(registry, v3)
    with pytest.raises(Pinned, match="rollback is refused"):
        manual_rollback(registry, v1)
    assert statuses(registry)[v3] == "candidate" and registry.pinned() == pin

    assert manual_promote(registry, v3, "hotfix", force=True, by="bob@ops") == [v3]
    moved = registry.pinned()
    assert (moved.version, moved.by) == (v3, "bob@ops") and "forced promote (was candidate): hotfix" in moved.reason
    # A forced rollback of the pinned version restores previous_stable (the newest formerly stable
    # version not rolled back: v2) and pins it.
    assert manual_rollback(registry, v3, force=True, by="carol@ops") == [v2, v3]
    assert statuses(registry) == {0: "retired", v1: "retired", v2: "stable", v3: "rolled_back"}
    assert registry.pinned().version == v2 and registry.pinned().by == "carol@ops"
    assert step(registry, sessions, POLICY).action == "pinned"


class _PinBlindRegistry(Registry):
    """A controller that read the registry just before an operator pinned the line."""

    def pinned(self):
        return None


def test_a_decision_taken_before_a_pin_is_not_applied_after_it(registry, sessions):
    v1 = publish(registry)
    blind = _PinBlindRegistry(sessions, registry.store, LINE)
    manual_pin(registry, 0, "alice@ops")
    d = step(blind, sessions, POLICY)  # decides "canary" on a stale view; the compare-and-set refuses it
    assert (d.action, d.changed) == ("none", False) and "pinned to v0 by alice@ops" in d.reason
    assert statuses(registry) == {0: "stable", v1: "candidate"}


def test_a_pin_survives_a_restart_of_every_process(registry, migrated_db_url, tmp_path):
    """``flywheel rollout pin`` in one process, ``status`` in another, the controller in a third
    (this one, on a fresh engine): the pin is the database's, no process's."""
    import subprocess
    import sys

    from flywheel.db.session import make_engine, make_session_factory

    v1 = publish(registry)
    config = tmp_path / "flywheel.json"
    config.write_text(json.dumps({
        "data_dir": str(tmp_path / "data"), "db": {"url": migrated_db_url}, "model": {"line": LINE},
        "store": {"path": str(tmp_path / "store")}, "bus": {"topic_prefix": f"t{uuid.uuid4().hex[:8]}."},
        "rollout": POLICY.model_dump()}))

    def cli(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "launch.cli", "--config", str(config), "rollout", *argv],
                              capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2])

    pinned = cli("pin", "0", "--reason", "survives")
    assert pinned.returncode == 0, pinned.stderr
    shown = cli("status")
    assert shown.returncode == 0, shown.stderr
    assert "pinned to v0 by " in shown.stdout and ": survives" in shown.stdout
    assert "next decision: pinned v0" in shown.stdout and f"holding back candidates v{v1}" in shown.stdout

    engine = make_engine(migrated_db_url)
    try:
        sessions = make_session_factory(engine)
        again = Registry(sessions, FolderStore(tmp_path / "store"), LINE)
        pin = again.pinned()
        assert (pin.version, pin.reason) == (0, "survives") and "@" in pin.by
        assert step(again, sessions, POLICY).action == "pinned"
        assert statuses(again) == {0: "stable", v1: "candidate"}
    finally:
        engine.dispose()


def _settings(migrated_db_url: str, tmp_path: Path):
    return load_settings(data_dir=str(tmp_path / "data"), db={"url": migrated_db_url}, model={"line": LINE},
                         store={"path": str(tmp_path / "store")}, bus={"topic_prefix": f"t{uuid.uuid4().hex[:8]}."},
                         rollout=POLICY.model_dump())


def test_the_pin_cli_commands_and_their_exit_codes(registry, sessions, migrated_db_url, tmp_path, capsys):
    settings = _settings(migrated_db_url, tmp_path)
    other = Registry(sessions, registry.store, "other-line")
    rng = random.Random(3)
    other.ensure_base(make_state(rng), reason="other base")
    for _ in range(4):
        other.publish(make_state(rng), parent=None)
    v1 = publish(registry)
    parser = build_parser()

    def run(*argv: str) -> tuple[int, str, str]:
        code = dispatch(parser.parse_args(["rollout", *argv]), settings)
        out = capsys.readouterr()
        return code, out.out, out.err

    code, _, err = run("pin", "99")
    assert code == 1 and f"model line '{LINE}' has no version 99" in err
    code, _, err = run("pin", "4")  # only the other line has a v4
    assert code == 1 and "has no version 4 (model lines with a v4: other-line; this command acts on model.line)" in err
    code, _, err = run("pin", "other-line:1")
    assert code == 1 and "v1 of model line 'other-line' is not this deployment's: model.line is 'roll-line'" in err
    assert run("unpin")[0:3:2] == (1, f"flywheel rollout unpin: model line '{LINE}' is not pinned\n")
    assert run("unpin", "1")[0] == 2
    assert run("pin")[0] == 2
    with pytest.raises(SystemExit) as usage:
        parser.parse_args(["rollout", "pin", "latest"])
    assert usage.value.code == 2
    assert registry.pinned() is None and other.pinned() is None

    code, out, _ = run("pin", f"{LINE}:0", "--reason", "freeze")
    assert code == 0 and "pinned to v0 by " in out and ": freeze" in out
    pin = registry.pinned()
    assert pin.version == 0 and "@" in pin.by and pin.reason == "freeze"
    code, out, _ = run("status")
    assert code == 0 and f"pinned to v0 by {pin.by}" in out and "next decision: pinned v0" in out
    assert f"v{v1}" in out and "(automatic rollout frozen" in out
    code, _, err = run("promote", str(v1))
    assert code == 1 and "is pinned to v0" in err and "--force" in err and "unpin" in err
    code, _, err = run("rollback", "0")
    assert code == 1 and "rollback is refused while pinned" in err
    assert statuses(registry) == {0: "stable", v1: "candidate"}
    assert dispatch(parser.parse_args(["rollout", "status", "--json"]), settings) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["pin"]["version"] == 0 and report["next_decision"]["action"] == "pinned"

    code, out, _ = run("promote", f"v{v1}", "--force", "--reason", "hotfix")
    assert code == 0 and f"v{v1}: stable" in out and f"pinned to v{v1}" in out
    code, out, _ = run("unpin", "--reason", "done")
    assert code == 0 and f"unpinned {LINE} (was pinned to v{v1}" in out
    assert registry.pinned() is None
    assert "unpinned by" in registry.transitions(v1)[-1]["reason"]


# --- a failed load implicates its chain ---------------------------------------------------------------


def corrupt(registry: Registry, version: int) -> bytes:
    """Flip 64 bytes in the middle of ``version``'s object in the store; returns the original bytes."""
    path = registry.store.root / registry.get(version).store_key
    original = path.read_bytes()
    middle = len(original) // 2
    path.write_bytes(original[:middle] + bytes(b ^ 0xFF for b in original[middle:middle + 64])
                     + original[middle + 64:])
    return original


def repair(registry: Registry, version: int, original: bytes) -> None:
    (registry.store.root / registry.get(version).store_key).write_bytes(original)


def node_loads(registry: Registry, sessions, node_id: str, version: int, live: int = 0) -> None:
    """A node on ``live`` tries to load ``version`` as ``serving.node.updater`` does (from its live
    version's weights) and reports the outcome in its database heartbeat."""
    from flywheel.weights.registry import WeightsError

    try:
        registry.load(version, base=(live, registry.load(live)))
    except WeightsError as exc:
        report(sessions, node_id, live, "failed_update", f"version {version}: {type(exc).__name__}: {exc}")
    else:
        report(sessions, node_id, version, "serving", f"updated {live} -> {version}")


def test_a_canary_no_node_can_load_takes_the_candidates_on_its_chain_with_it_until_cleared(registry, sessions):
    v1, v2 = publish(registry), publish(registry)
    assert [registry.get(v).kind for v in (v1, v2)] == ["delta", "delta"] and registry.get(v2).parent == v1
    original = corrupt(registry, v1)  # v2's chain runs through the damaged v1
    events: list[VersionEvent] = []
    assert (step(registry, sessions, POLICY, events.append).action, statuses(registry)[v2]) == ("canary", "canary")
    for node in ("node-a", "node-b"):
        node_loads(registry, sessions, node, v2)
    d = step(registry, sessions, POLICY, events.append)
    assert (d.action, d.version, d.was) == ("rollback", v2, "canary") and d.figures["implicated"] == [v1]
    assert f"version {v1} (" in d.reason  # the nodes' reason names the damaged object
    assert statuses(registry) == {0: "stable", v1: "rolled_back", v2: "rolled_back"}
    assert [(e.version, e.status) for e in events] == [(v2, "canary"), (v1, "rolled_back"), (v2, "rolled_back")]
    mine = registry.transitions(v1)[-1]
    assert (mine["from_status"], mine["to_status"]) == ("candidate", "rolled_back")
    assert f"implicated in a failed load: the chain of canary v{v2} runs through v{v1}" in mine["reason"]
    assert f"failed load: no node can load canary v{v2}" in registry.transitions(v2)[-1]["reason"]

    # Still damaged: clearing re-verifies, fails, says why and leaves it (and the audit) as it was.
    with pytest.raises(VerificationFailed, match=f"v{v1} stays rolled_back: re-verification of v0 \\(full\\) -> v{v1} "
                                                 f"failed: version {v1} "):
        manual_clear(registry, v1, by="alice@ops")
    assert registry.get(v1).status == "rolled_back" and registry.transitions(v1)[-1] == mine

    # Repaired: the implicated versions stay ineligible, whatever the timing; later versions move on.
    repair(registry, v1, original)
    report(sessions, "node-a", 0, "serving", "")
    report(sessions, "node-b", 0, "serving", "")
    for _ in range(2):
        d = step(registry, sessions, POLICY)
        assert (d.action, d.version) == ("none", None) and "no candidate newer than stable" in d.reason
    v3 = publish(registry)  # a delta on v2, chained through the repaired v1: loads
    assert registry.get(v3).parent == v2
    d = step(registry, sessions, POLICY)
    assert (d.action, d.version) == ("canary", v3)
    node_loads(registry, sessions, "node-a", v3)
    assert statuses(registry) == {0: "stable", v1: "rolled_back", v2: "rolled_back", v3: "canary"}

    with pytest.raises(RolloutError, match=f"v{v3} is canary; only a rolled-back version can be cleared"):
        manual_clear(registry, v3)
    assert manual_clear(registry, v1, "object repaired", by="alice@ops") == [v1]
    cleared = registry.transitions(v1)[-1]
    assert (cleared["from_status"], cleared["to_status"]) == ("rolled_back", "candidate")
    assert cleared["reason"].startswith(f"cleared by alice@ops: re-verified end to end (v0 (full) -> v{v1}, every "
                                        f"hash checked, sha256 {registry.get(v1).sha256[:12]}); was rolled_back")
    assert cleared["reason"].endswith(": object repaired")


def test_promoting_a_rolled_back_version_re_verifies_it_as_a_clear_does(registry, sessions):
    v1 = publish(registry)
    registry.set_status(v1, "canary", reason="test")
    registry.set_status(v1, "rolled_back", reason="test: implicated in a failed load")
    original = corrupt(registry, v1)
    with pytest.raises(VerificationFailed, match=f"v{v1} stays rolled_back: re-verification of v0 \\(full\\) -> v{v1}"):
        manual_promote(registry, v1, "looks fine to me")
    assert statuses(registry) == {0: "stable", v1: "rolled_back"}
    repair(registry, v1, original)
    assert manual_promote(registry, v1, "object repaired") == [v1]
    assert statuses(registry) == {0: "retired", v1: "stable"}
    reason = registry.transitions(v1)[-1]["reason"]
    assert reason.startswith(f"manual promote (was rolled_back); re-verified end to end (v0 (full) -> v{v1}, every "
                             "hash checked") and reason.endswith(": object repaired"), reason


def test_a_canary_that_served_nothing_while_a_node_failed_to_load_it_implicates_its_chain(registry, sessions):
    v1, v2 = publish(registry), publish(registry)
    assert step(registry, sessions, POLICY).version == v2
    serve(sessions, 0, 150)  # stable served min_samples, the canary nothing
    report(sessions, "node-a", 0, "failed_update", f"version {v2}: WeightsError: version {v1} (k): corrupt")
    report(sessions, "node-b", 0, "serving", "")  # has not tried it: not every node refused it
    d = step(registry, sessions, POLICY)
    assert (d.action, d.version, d.figures["implicated"]) == ("rollback", v2, [v1])
    assert "served nothing" in d.reason and "failed to load it: node-a: WeightsError" in d.reason
    assert statuses(registry) == {0: "stable", v1: "rolled_back", v2: "rolled_back"}

    # A canary that served nothing and that no node failed to load is rolled back alone.
    v3, v4 = publish(registry), publish(registry)
    assert step(registry, sessions, POLICY).version == v4
    report(sessions, "node-a", 0, "serving", "")
    serve(sessions, 0, 150)
    d = step(registry, sessions, POLICY)
    assert (d.action, d.version) == ("rollback", v4) and "implicated" not in d.figures
    assert statuses(registry)[v3] == "candidate" and statuses(registry)[v4] == "rolled_back"
    assert step(registry, sessions, POLICY).version == v3  # no failed load: v3 is eligible


def test_a_failed_load_implicates_only_candidates_since_the_last_version_known_good(registry, sessions):
    from serving.rollout_policy import implicated

    v1, v2, v3, v4 = (publish(registry) for _ in range(4))
    manual_promote(registry, v1)  # v0 retired, v1 stable
    manual_rollback(registry, v1)  # v0 stable again, v1 rolled back (no longer known good)
    manual_promote(registry, v2)
    registry.set_status(v3, "canary", reason="test")
    registry.set_status(v3, "rolled_back", reason="test: bad answers")
    versions = registry.versions()
    assert implicated(versions, v4, v2) == []  # v3 rolled back already, v2 stable: known good
    assert implicated(versions, v4, None) == []
    assert implicated(versions, v2, 0) == []  # v1 rolled back is walked past, v0 stops it
    registry.set_status(v3, "candidate", reason="test")
    assert implicated(registry.versions(), v4, v2) == [v3]
    assert implicated(registry.versions(), v4, v3) == []  # nothing newer than the floor
    assert implicated(registry.versions(), 0, None) == []  # a full version has no chain
    # Below the version the fleet serves, a version stable on paper (retired) is implicated too.
    manual_promote(registry, v3)
    assert statuses(registry)[v2] == "retired"
    assert implicated(registry.versions(), v4, 0) == [v2]  # v3 stable: not implicable, walked past


def test_a_stable_version_no_node_can_load_restores_what_the_fleet_serves(registry, sessions):
    """Two promotions before the nodes report: the previous stable version is one no node ever
    loaded, whose chain holds the same damaged object; the fleet never left v0, so v0 comes back."""
    direct = POLICY.model_copy(update={"canary_fraction": 0.0})
    v1, v2 = publish(registry), publish(registry)
    assert step(registry, sessions, direct).version == v2
    v3 = publish(registry)
    assert step(registry, sessions, direct).version == v3 and statuses(registry)[v2] == "retired"
    original = corrupt(registry, v1)
    for node in ("node-a", "node-b"):
        node_loads(registry, sessions, node, v3)
    events: list[VersionEvent] = []
    d = step(registry, sessions, direct, events.append)
    assert (d.action, d.version, d.figures["restore"], d.figures["implicated"]) == ("rollback", v3, 0, [v2, v1])
    assert statuses(registry) == {0: "stable", v1: "rolled_back", v2: "rolled_back", v3: "rolled_back"}
    assert [(e.version, e.status) for e in events] == [(v2, "rolled_back"), (v1, "rolled_back"), (0, "stable"),
                                                       (v3, "rolled_back")]
    assert f"the chain of stable v{v3} runs through v{v2}" in registry.transitions(v2)[-1]["reason"]
    assert "v0 restored" in registry.transitions(v3)[-1]["reason"]
    assert registry.transitions(0)[-1]["reason"].startswith(f"rollout: restored instead of v{v3}: rollout: failed load")
    repair(registry, v1, original)
    assert step(registry, sessions, direct).action == "none"  # all three stay out until cleared
    assert manual_clear(registry, v2, by="alice@ops") == [v2]
    assert step(registry, sessions, direct).version == v2 and statuses(registry)[v2] == "stable"


def test_nodes_on_different_versions_fall_back_to_the_previous_stable_version(registry, sessions):
    direct = POLICY.model_copy(update={"canary_fraction": 0.0})
    v1 = publish(registry)
    assert step(registry, sessions, direct).version == v1
    v2 = publish(registry)
    assert step(registry, sessions, direct).version == v2
    report(sessions, "node-a", 0, "failed_update", f"version {v2}: WeightsError: corrupt")
    report(sessions, "node-b", v1, "failed_update", f"version {v2}: WeightsError: corrupt")
    d = step(registry, sessions, direct)
    assert (d.action, d.version, d.figures["restore"], d.figures["implicated"]) == ("rollback", v2, v1, [])
    assert statuses(registry) == {0: "retired", v1: "stable", v2: "rolled_back"}


def test_the_clear_command(registry, sessions, migrated_db_url, tmp_path, capsys):
    settings = _settings(migrated_db_url, tmp_path)
    parser = build_parser()

    def run(*argv: str) -> tuple[int, str, str]:
        code = dispatch(parser.parse_args(["rollout", *argv]), settings)
        out = capsys.readouterr()
        return code, out.out, out.err

    v1, v2 = publish(registry), publish(registry)
    original = corrupt(registry, v1)
    step(registry, sessions, POLICY)
    for node in ("node-a", "node-b"):
        node_loads(registry, sessions, node, v2)
    assert step(registry, sessions, POLICY).action == "rollback"
    assert statuses(registry) == {0: "stable", v1: "rolled_back", v2: "rolled_back"}

    assert run("clear")[0] == 2
    code, _, err = run("clear", "0")
    assert code == 1 and "v0 is stable; only a rolled-back version can be cleared" in err
    code, _, err = run("clear", f"v{v2}")  # its chain runs through the damaged v1
    assert code == 1 and f"flywheel rollout clear: v{v2} stays rolled_back: re-verification of v0 (full) -> v{v1} -> " \
                         f"v{v2} failed: version {v1} (" in err
    assert statuses(registry)[v2] == "rolled_back"
    repair(registry, v1, original)
    manual_pin(registry, 0, "bob@ops", "freeze")
    code, _, err = run("clear", str(v2))
    assert code == 1 and "clear is refused while pinned" in err and "--force clears anyway (the pin stays)" in err
    code, out, _ = run("clear", str(v2), "--force", "--reason", "store fixed")
    assert code == 0 and f"v{v2}: candidate" in out and "re-verified end to end" in out
    reason = registry.transitions(v2)[-1]["reason"]
    assert reason.startswith("cleared by ") and "@" in reason and reason.endswith("was rolled_back: store fixed")
    assert registry.pinned().version == 0 and statuses(registry)[v1] == "rolled_back"
    manual_unpin(registry, "bob@ops")
    assert step(registry, sessions, POLICY).version == v2  # cleared: eligible again

    v3 = publish(registry)
    manual_promote(registry, v3)
    code, out, _ = run("clear", str(v1))
    assert code == 0 and f"v{v1} is older than stable v{v3}: the controller will not canary it" in out


def test_the_admin_clear_route_needs_the_admin_key_and_re_verifies(registry, sessions, migrated_db_url, tmp_path):
    from fastapi.testclient import TestClient

    from flywheel.keys import create_key
    from serving.gateway.app import create_app

    settings = load_settings(data_dir=str(tmp_path / "data"), db={"url": migrated_db_url}, model={"line": LINE},
                             store={"path": str(tmp_path / "store")},
                             bus={"kind": "local", "topic_prefix": f"t{uuid.uuid4().hex[:8]}."},
                             gateway={"auth": "on", "upstream": "http://127.0.0.1:9"}, rollout=POLICY.model_dump())
    admin_id, admin = create_key(sessions, "ops", role="admin", name="admin")
    _, tenant = create_key(sessions, "acme", name="acme")
    v1 = publish(registry)
    original = corrupt(registry, v1)
    step(registry, sessions, POLICY)
    node_loads(registry, sessions, "node-a", v1)
    assert step(registry, sessions, POLICY).action == "rollback" and statuses(registry)[v1] == "rolled_back"
    url = f"/admin/versions/{v1}/clear"
    with TestClient(create_app(settings)) as client:
        assert client.post(url).status_code == 401
        r = client.post(url, headers={"Authorization": f"Bearer {tenant}"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_required"
        as_admin = {"Authorization": f"Bearer {admin}"}
        r = client.post(url, headers=as_admin)
        assert r.status_code == 409 and r.json()["error"]["code"] == "verification_failed", r.text
        assert f"v{v1} stays rolled_back" in r.json()["error"]["message"]
        repair(registry, v1, original)
        r = client.post(url, headers=as_admin, json={"reason": "ticket 9"})
        assert r.status_code == 200 and r.json() == {"changed": [{"version": v1, "status": "candidate"}]}, r.text
        r = client.post(url, headers=as_admin)
        assert r.status_code == 409 and r.json()["error"]["code"] == "rollout_conflict"
    reason = registry.transitions(v1)[-1]["reason"]
    assert reason.startswith(f"cleared by admin API key {admin_id.key_id}: re-verified end to end")
    assert reason.endswith(": ticket 9")


# --- the release calendar ---------------------------------------------------------------------------


def calendar(**rules) -> RolloutSettings:
    """POLICY with release-calendar rules (validated, as settings would be)."""
    return RolloutSettings(**{**POLICY.model_dump(), **rules})


def next_local(zone: str, weekday: int, hour: int, after: datetime) -> datetime:
    """The first ``weekday`` (0 = Monday) at ``hour``:00 in ``zone`` on a later local day than ``after``."""
    tz = ZoneInfo(zone)
    day = after.astimezone(tz).date() + timedelta(days=1)
    while day.weekday() != weekday:
        day += timedelta(days=1)
    return datetime.combine(day, time(hour), tz)


def test_a_ready_canary_waits_outside_the_release_window_and_is_promoted_inside(registry, sessions):
    policy = calendar(timezone="Europe/Berlin", windows=["mon-fri 09:00-17:00"])
    saturday = next_local("Europe/Berlin", 5, 12, datetime.now(UTC))
    monday = next_local("Europe/Berlin", 0, 9, saturday)
    v1 = publish(registry)
    d = step(registry, sessions, policy, now=saturday)
    assert (d.action, d.version) == ("canary", v1)  # starting a canary is no promotion: not held
    serve(sessions, 0, 300)
    serve(sessions, v1, 300)  # enough, and equal: the verdict is promote
    d = step(registry, sessions, policy, now=saturday)
    assert (d.action, d.version, d.changed, d.was) == ("wait", v1, False, "canary")
    assert d.reason == (f"ready canary v{v1} waits: outside the release windows (mon-fri 09:00-17:00 Europe/Berlin); "
                        f"next window opens {monday:%Y-%m-%d} 09:00 {monday:%Z}")
    assert d.figures["calendar"]["next_window"] == monday.isoformat() and d.figures["calendar"]["held_by"] == ["window"]
    assert d.figures["canary"]["generations"] == 300  # the verdict's figures are kept
    assert statuses(registry) == {0: "stable", v1: "canary"}
    d = step(registry, sessions, policy, now=monday + timedelta(minutes=30))
    assert (d.action, d.version) == ("promote", v1) and d.figures["calendar"]["open_now"]
    assert statuses(registry) == {0: "retired", v1: "stable"}


def test_a_freeze_holds_a_promotion_but_never_a_rollback(registry, sessions):
    now = datetime.now(UTC)
    freeze = {"start": (now - timedelta(hours=1)).isoformat(), "end": (now + timedelta(days=7)).isoformat(),
              "reason": "year-end freeze"}
    policy = calendar(freezes=[freeze])
    v1 = publish(registry)
    assert step(registry, sessions, policy).action == "canary"  # canary starts go on during a freeze
    serve(sessions, 0, 300, thumbs_down=15)
    serve(sessions, v1, 300, thumbs_down=15)
    d = step(registry, sessions, policy, now=now + timedelta(hours=1))
    assert d.action == "wait" and d.reason.startswith(f"ready canary v{v1} waits: release freeze: year-end freeze")
    assert d.figures["calendar"]["freeze"]["reason"] == "year-end freeze"
    serve(sessions, v1, 300, thumbs_down=200)  # the canary turns bad: rolled back, freeze or not
    d = step(registry, sessions, policy, now=now + timedelta(hours=1))
    assert (d.action, d.version) == ("rollback", v1), d.reason
    assert statuses(registry) == {0: "stable", v1: "rolled_back"}
    # A direct promotion (canary_fraction 0) waits for the freeze's end too.
    direct = calendar(canary_fraction=0.0, freezes=[freeze])
    v2 = publish(registry)
    d = step(registry, sessions, direct, now=now + timedelta(hours=1))
    assert (d.action, d.version) == ("wait", v2) and d.reason.startswith(f"ready candidate v{v2} waits: release freeze")
    assert d.figures["calendar"]["next_opportunity"] == datetime.fromisoformat(freeze["end"]).isoformat()
    assert step(registry, sessions, direct, now=now + timedelta(days=7)).action == "promote"
    assert statuses(registry)[v2] == "stable"


def test_the_daily_limit_holds_the_next_promotion_until_the_next_local_day(registry, sessions):
    now = datetime.now(UTC)
    zone = f"Etc/GMT{now.hour - 12:+d}"  # POSIX signs: local noon-ish now, midnight hours away either side
    policy = calendar(canary_fraction=0.0, timezone=zone, max_promotions_per_day=1)
    v1 = publish(registry)
    manual_promote(registry, v1, "hotfix")  # an operator's promotion: not the controller's to count
    v2 = publish(registry)
    d = step(registry, sessions, policy, now=now)
    assert (d.action, d.version) == ("promote", v2) and d.figures["calendar"]["promotions_today"] == 0
    v3 = publish(registry)
    d = step(registry, sessions, policy, now=now + timedelta(minutes=1))
    midnight = datetime.combine(now.astimezone(ZoneInfo(zone)).date() + timedelta(days=1), time(), ZoneInfo(zone))
    assert (d.action, d.version) == ("wait", v3)
    assert f"daily limit reached: 1 automatic promotion on {now.astimezone(ZoneInfo(zone)).date()} ({zone})" in d.reason
    assert d.figures["calendar"]["next_opportunity"] == midnight.isoformat()
    assert step(registry, sessions, policy, now=midnight - timedelta(seconds=1)).action == "wait"
    d = step(registry, sessions, policy, now=midnight)
    assert (d.action, d.version) == ("promote", v3) and statuses(registry)[v3] == "stable"


def test_min_soak_holds_a_fresh_canary_and_a_fresh_direct_candidate(registry, sessions):
    policy = calendar(min_soak_s=3600)
    v1 = publish(registry)
    assert step(registry, sessions, policy).action == "canary"
    started = registry.transitions(v1)[-1]["at"]
    serve(sessions, 0, 300)
    serve(sessions, v1, 300)
    d = step(registry, sessions, policy, now=started + timedelta(minutes=10))
    assert d.action == "wait" and d.reason.startswith(f"ready canary v{v1} waits: soaking 600s of min_soak_s 3600")
    assert d.figures["calendar"]["soak_until"] == (started + timedelta(hours=1)).isoformat()
    assert step(registry, sessions, policy, now=started + timedelta(hours=1)).action == "promote"
    v2 = publish(registry)
    published = registry.get(v2).created_at
    direct = calendar(canary_fraction=0.0, min_soak_s=3600)
    d = step(registry, sessions, direct, now=published + timedelta(minutes=59))
    assert (d.action, d.version) == ("wait", v2) and "soaking" in d.reason
    assert step(registry, sessions, direct, now=published + timedelta(minutes=60)).action == "promote"


def test_status_the_cli_and_the_admin_api_show_the_calendar_and_why_a_ready_canary_waits(
        registry, sessions, migrated_db_url, tmp_path, capsys):
    from fastapi.testclient import TestClient

    from flywheel.keys import create_key
    from serving.gateway.app import create_app
    from serving.rollout import status_report

    later = (datetime.now(UTC) + timedelta(days=3)).strftime("%a").lower()  # not today or tomorrow
    policy = calendar(windows=[f"{later} 00:00-24:00"], max_promotions_per_day=3)
    v1 = publish(registry)
    assert step(registry, sessions, policy).action == "canary"
    serve(sessions, 0, 300)
    serve(sessions, v1, 300)
    report = status_report(registry, sessions, policy)
    shown = report["calendar"]
    assert not shown["open_now"] and shown["windows"] == [f"{later} 00:00-24:00"] and shown["timezone"] == "UTC"
    assert shown["promotions_today"] == 0 and shown["max_promotions_per_day"] == 3
    assert shown["holding"]["version"] == v1 and "outside the release windows" in shown["holding"]["reason"]
    assert report["next_decision"]["action"] == "wait"

    settings = load_settings(data_dir=str(tmp_path / "data"), db={"url": migrated_db_url}, model={"line": LINE},
                             store={"path": str(tmp_path / "store")},
                             bus={"kind": "local", "topic_prefix": f"t{uuid.uuid4().hex[:8]}."},
                             gateway={"auth": "on", "upstream": "http://127.0.0.1:9"}, rollout=policy.model_dump())
    assert dispatch(build_parser().parse_args(["rollout", "status"]), settings) == 0
    out = capsys.readouterr().out
    assert f"next decision: wait v{v1}: ready canary v{v1} waits: outside the release windows" in out
    assert f"calendar: release windows: {later} 00:00-24:00 (UTC): closed; next window opens" in out
    assert "calendar: automatic promotions today: 0 of max_promotions_per_day 3" in out

    _, admin = create_key(sessions, "ops", role="admin", name="admin")
    with TestClient(create_app(settings)) as client:
        r = client.get("/admin/versions", headers={"Authorization": f"Bearer {admin}"})
    assert r.status_code == 200, r.text
    assert r.json()["calendar"]["holding"]["version"] == v1
    assert r.json()["calendar"]["next_window"] == shown["next_window"]
