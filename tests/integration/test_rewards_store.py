"""The rewards stage on real databases (PostgreSQL and SQLite): the worker over the local-log bus,
the held-out slice, per-version stats and anomaly flags, rescore and report.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from flywheel.bus import Record, dlq_topic, make_bus
from flywheel.db.models import RewardVersionStats, ScoredTrajectoryRow, Trajectory
from flywheel.db.session import insert_ignore, make_engine, make_session_factory
from flywheel.events import FeedbackEvent, ScoredTrajectory, Segment, TrajectoryEvent, Turn
from flywheel.settings import Settings
from launch.cli import main as cli_main
from rewards import store
from rewards.guards import is_held_out
from rewards.normalise import Normaliser
from rewards.rescore import report, rescore
from rewards.scorer import Scorer
from rewards.spec import SpecError, load_spec
from rewards.worker import process
from rewards.worker import run as rewards_run
from tests.fixtures.kafka import local_test_settings
from tests.fixtures.roles import RoleThread, wait_until

pytestmark = pytest.mark.integration

TENANT = "acme"
LINE = "tiny-sim"


def write_spec(path: Path, version: str, extra: str = "") -> Path:
    path.write_text(f'extends = "default"\nversion = "{version}"\n{extra}')
    return path


def split_sessions(fraction: float, n_train: int, n_held: int, prefix: str) -> tuple[list[str], list[str]]:
    """Session ids that the hash puts in the training slice and in the held-out slice."""
    train: list[str] = []
    held: list[str] = []
    i = 0
    while len(train) < n_train or len(held) < n_held:
        sid = f"{prefix}-{i}"
        bucket = held if is_held_out(TENANT, sid, fraction) else train
        if len(bucket) < (n_held if bucket is held else n_train):
            bucket.append(sid)
        i += 1
    return train, held


def trajectory(session_id: str, version: int, solved: bool, *, revision: int = 0, prompt: str | None = "p",
               extra: list[FeedbackEvent] = ()) -> TrajectoryEvent:
    """One single-turn session: solved (thumbs up + task solved: 2.0) or failed (thumbs down + abandon: -1.5)."""
    gid = f"{session_id}-g0"
    seg = Segment(tokens=[5, 6, 7, 8], mask=[0, 0, 1, 1], logprobs=[0.0, 0.0, -0.5, -0.25],
                  turns=[Turn(generation_id=gid, start=2, end=4, behaviour_version=version)])

    def fb(kind: str, signal: str, value: float | None, generation_id: str | None = None) -> FeedbackEvent:
        return FeedbackEvent(tenant=TENANT, session_id=session_id, feedback_id=f"{session_id}-{signal}",
                             generation_id=generation_id, kind=kind, signal=signal, value=value)

    feedback = ([fb("explicit", "thumbs", 1, gid), fb("outcome", "task_solved", 1)] if solved
                else [fb("explicit", "thumbs", -1, gid), fb("implicit", "abandon", None)])
    return TrajectoryEvent(tenant=TENANT, session_id=session_id, trajectory_id=f"traj-{session_id}", revision=revision,
                           model_line=LINE, segments=[seg], generation_ids=[gid], feedback=feedback + list(extra),
                           closed_reason="outcome", prompt_key=prompt, ts=datetime(2025, 1, 1, tzinfo=UTC))


def settings_for(tmp_path: Path, db_url: str, spec_path: Path) -> Settings:
    """The worker scores trajectories these tests produce themselves: no ingest stored them."""
    return local_test_settings(tmp_path / "data", db={"url": db_url, "wait_s": 10},
                               rewards={"spec_path": str(spec_path), "require_stored": False})


def send(settings: Settings, topic: str, values: list[tuple[str, bytes]]) -> None:
    bus = make_bus(settings)
    producer = bus.producer()
    for key, value in values:
        producer.send(topic, key, value)
    producer.flush()
    producer.close()
    bus.close()


def read_topic(settings: Settings, topic: str, group: str, timeout_s: float = 3.0) -> list[Record]:
    bus = make_bus(settings)
    bus.ensure_topics([topic])
    consumer = bus.consumer(group, [topic])
    out: list[Record] = []
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            got = consumer.poll(timeout_s=0.3, max_records=500)
            out += got
            if out and not got:
                break
    finally:
        consumer.close()
        bus.close()
    return out


def stats_table(sessions: Any, spec_version: str) -> dict[int, tuple[int, float, int, float, bool]]:
    with sessions() as db:
        return {r.model_version: (r.train_count, round(r.train_sum, 9), r.held_out_count, round(r.held_out_sum, 9), r.flagged)
                for r in store.stats_rows(db, spec_version)}


def scored_rows(sessions: Any, spec_version: str) -> dict[str, dict[str, Any]]:
    with sessions() as db:
        rows = db.execute(select(ScoredTrajectoryRow.event_id, ScoredTrajectoryRow.payload)
                          .where(ScoredTrajectoryRow.reward_spec_version == spec_version)).all()
    return dict(rows)


def test_worker_scores_once_holds_out_and_counts_per_version(tmp_path: Path, migrated_db_url: str) -> None:
    spec_path = write_spec(tmp_path / "spec.toml", "it-v1", "[guards]\nheld_out_fraction = 0.3\n")
    settings = settings_for(tmp_path, migrated_db_url, spec_path)
    sessions = make_session_factory(make_engine(migrated_db_url))
    train, held = split_sessions(0.3, 8, 4, "w")
    trajs = [trajectory(s, version=1 + i % 2, solved=i % 3 != 0, prompt=f"p{i % 4}") for i, s in enumerate(train + held)]
    source = settings.topic("trajectories")
    bus = make_bus(settings)
    bus.ensure_topics([source, settings.topic("scored")])
    bus.close()
    payloads = [(t.session_id, t.to_bytes()) for t in trajs]
    send(settings, source, payloads + [("bad", b"not a trajectory")] + payloads)  # every trajectory twice

    stop = threading.Event()
    worker = RoleThread("rewards", rewards_run, settings, stop)
    worker.start()
    try:
        wait_until("every trajectory scored", lambda: len(scored_rows(sessions, "it-v1")) == len(trajs) or worker.error)
        time.sleep(1.0)  # long enough for a duplicate row or event to show up
    finally:
        stop.set()
        worker.join(timeout=30)
    assert worker.error is None, worker.error

    rows = scored_rows(sessions, "it-v1")
    assert len(rows) == len(trajs)
    by_session = {p["session_id"]: ScoredTrajectory.model_validate(p) for p in rows.values()}
    assert {s for s, p in by_session.items() if p.held_out} == set(held)
    assert all(p.turn_advantages is None for p in by_session.values() if p.held_out)
    assert all(len(p.turn_advantages or []) == 1 for s, p in by_session.items() if s in train)
    assert all(p.reward_spec_version == "it-v1" for p in by_session.values())
    totals = {t.session_id: (2.0 if i % 3 != 0 else -1.5) for i, t in enumerate(trajs)}
    assert {s: p.total_reward for s, p in by_session.items()} == totals

    # The training topic got each training trajectory (twice: the duplicates were re-produced), never a held-out one.
    produced = [ScoredTrajectory.from_bytes(r.value) for r in read_topic(settings, settings.topic("scored"), "t-read")]
    assert {p.session_id for p in produced} == set(train)
    assert not any(p.held_out for p in produced)
    assert [r.value for r in read_topic(settings, dlq_topic(source), "t-dlq")] == [b"not a trajectory"]

    # Per-version stats: version 1 + i % 2 served session i; held-out and training apart, each counted once.
    expected: dict[int, list[float]] = {}
    for t in trajs:
        e = expected.setdefault(t.segments[0].turns[0].behaviour_version, [0, 0.0, 0, 0.0])
        k = 2 if t.session_id in held else 0
        e[k] += 1
        e[k + 1] += totals[t.session_id]
    assert stats_table(sessions, "it-v1") == {v: (e[0], e[1], e[2], e[3], False) for v, e in expected.items()}

    # A replayed batch (records read back, a fresh worker state) inserts nothing and produces the
    # stored events byte for byte.
    spec = load_spec(spec_path)
    records = [r for r in read_topic(settings, source, "t-src") if r.key != "bad"]
    first = {p.event_id: p.to_bytes() for p in produced}
    again = replay(settings, sessions, spec, records)
    assert again and all(first[ScoredTrajectory.from_bytes(v).event_id] == v for v in again)
    assert len(scored_rows(sessions, "it-v1")) == len(trajs)

    # Late feedback: revision 1 of a training session (a rating of 1 -> -1 more) replaces revision 0 in the stats.
    late = FeedbackEvent(tenant=TENANT, session_id=train[1], feedback_id="late", kind="explicit", signal="rating", value=1)
    rev1 = trajectory(train[1], version=2, solved=True, revision=1, prompt="p1", extra=[late])
    replay(settings, sessions, spec, [Record(source, 0, 10_000, rev1.session_id, rev1.to_bytes())])
    expected[2][1] -= 1.0
    assert stats_table(sessions, "it-v1") == {v: (e[0], round(e[1], 9), e[2], e[3], False) for v, e in expected.items()}
    # ... and rebuilding the stats from the scored rows alone gives the same numbers.
    with sessions() as db, db.begin():
        store.rebuild_stats(db, spec)
    assert stats_table(sessions, "it-v1") == {v: (e[0], round(e[1], 9), e[2], e[3], False) for v, e in expected.items()}

    # A restarted worker's normaliser: the training rows, oldest first, held-out ones left out.
    restored = Normaliser(spec.normalise)
    with sessions() as db:
        assert store.restore_normaliser(db, restored, "it-v1", 1000) == len(train) + 1
        ordered = db.scalars(select(ScoredTrajectoryRow.payload).order_by(ScoredTrajectoryRow.id)).all()
    by_hand = Normaliser(spec.normalise)
    for p in ordered:
        if not p["held_out"]:
            by_hand.observe(p["tenant"], p["model_line"], p["prompt_key"], p["turn_rewards"])
    for prompt in (None, "p1", "p3"):
        assert restored.baseline(TENANT, LINE, prompt, [0.5]) == by_hand.baseline(TENANT, LINE, prompt, [0.5])
    assert restored.baseline(TENANT, LINE, "p1", [0.5])[2] == "group"


def replay(settings: Settings, sessions: Any, spec: Any, records: list[Record]) -> list[bytes]:
    """Run the worker's batch step on ``records``; returns what it produced to the scored topic."""
    bus = make_bus(settings)
    consumer = bus.consumer("t-replay", [settings.topic("trajectories")])
    producer = bus.producer()
    topic = f"{settings.bus.topic_prefix}replayed"
    bus.ensure_topics([topic])
    try:
        process(records, consumer, sessions, producer, Scorer(spec), Normaliser(spec.normalise), topic, Counter(),
                require_stored=False)
    finally:
        producer.close()
        consumer.close()
        bus.close()
    group = f"t-replayed-{time.monotonic_ns()}"
    return [r.value for r in read_topic(settings, topic, group)]


def store_trajectories(sessions: Any, trajs: list[TrajectoryEvent]) -> None:
    with sessions() as db, db.begin():
        insert_ignore(db, Trajectory, [
            {"trajectory_id": t.trajectory_id, "revision": t.revision, "event_id": t.event_id, "tenant": t.tenant,
             "session_id": t.session_id, "model_line": t.model_line, "closed_reason": t.closed_reason, "ts": t.ts,
             "payload": t.model_dump(mode="json")}
            for t in trajs
        ])


def test_rescore_is_idempotent_flags_anomalies_and_never_touches_the_bus(tmp_path: Path, migrated_db_url: str) -> None:
    anomaly = "[guards]\nheld_out_fraction = 0.3\n[guards.anomaly]\nmin_train = 4\nmin_held_out = 2\ntrain_jump = 0.5\n"
    spec_a = write_spec(tmp_path / "a.toml", "rescore-a", anomaly)
    spec_b = write_spec(tmp_path / "b.toml", "rescore-b", anomaly + '[credit]\nrule = "uniform"\n')
    settings = settings_for(tmp_path, migrated_db_url, spec_a)
    sessions = make_session_factory(make_engine(migrated_db_url))
    train, held = split_sessions(0.3, 12, 6, "r")
    # v1: everything half solved. v2: training sessions all solved, held-out ones all failed (reward the
    # held-out slice does not confirm). v3: both improve together.
    trajs = []
    for v in (1, 2, 3):
        for i, s in enumerate(train[(v - 1) * 4 : v * 4]):
            trajs.append(trajectory(s, v, solved=(v > 1) or i % 2 == 0, prompt=None))
        for i, s in enumerate(held[(v - 1) * 2 : v * 2]):
            trajs.append(trajectory(s, v, solved=(v == 3) or (v == 1 and i == 0), prompt=None))
    store_trajectories(sessions, trajs)

    first = rescore(settings, str(spec_a))
    assert (first.trajectories, first.inserted, first.held_out) == (18, 18, 6)
    rows_a, stats_a = scored_rows(sessions, "rescore-a"), stats_table(sessions, "rescore-a")
    # v1: train 2 x 2.0 + 2 x -1.5, held 2.0 - 1.5; v2: train 4 x 2.0, held 2 x -1.5 -> flagged; v3: both up
    assert stats_a == {1: (4, 1.0, 2, 0.5, False), 2: (4, 8.0, 2, -3.0, True), 3: (4, 8.0, 2, 4.0, False)}
    assert all(p["turn_advantages"] is not None for p in rows_a.values() if not p["held_out"])

    second = rescore(settings, str(spec_a))
    assert (second.trajectories, second.inserted) == (18, 0)
    assert scored_rows(sessions, "rescore-a") == rows_a and stats_table(sessions, "rescore-a") == stats_a

    # Another spec version: rows of its own, the old ones untouched; no bus was ever opened.
    assert rescore(settings, str(spec_b)).inserted == 18
    assert len(scored_rows(sessions, "rescore-b")) == 18 and scored_rows(sessions, "rescore-a") == rows_a
    assert not settings.bus_log_path.exists()

    # The report, through the CLI, shows both spec versions, the rates and the flag with its reason.
    config = tmp_path / "flywheel.json"
    config.write_text(json.dumps(settings.model_dump(mode="json")))
    table = report(settings, "rescore-a")
    flagged = [r for r in table if r["flagged"]]
    assert [r["version"] for r in flagged] == [2] and "held-out moved" in flagged[0]["flag_reason"]
    assert table[1]["train_rate"] == 2.0 and table[1]["held_out_rate"] == -1.5
    return_code = cli_main(["--config", str(config), "rewards", "report"])
    assert return_code == 0


def test_cli_rescore_and_report(tmp_path: Path, sqlite_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    from flywheel.db.session import upgrade

    upgrade(sqlite_url)
    spec = write_spec(tmp_path / "cli.toml", "cli-v1", "[guards]\nheld_out_fraction = 0.5\n")
    settings = settings_for(tmp_path, sqlite_url, spec)
    store_trajectories(make_session_factory(make_engine(sqlite_url)), [trajectory(f"c{i}", 4, solved=True) for i in range(6)])
    config = tmp_path / "flywheel.json"
    config.write_text(json.dumps(settings.model_dump(mode="json")))
    assert cli_main(["--config", str(config), "rewards", "rescore", "--spec", str(spec)]) == 0
    assert "rescored 6 trajectories under cli-v1: 6 new rows" in capsys.readouterr().out
    assert cli_main(["--config", str(config), "rewards", "report"]) == 0
    out = capsys.readouterr().out
    assert "cli-v1" in out and "tiny-sim" in out and "+2.000" in out
    assert cli_main(["--config", str(config), "rewards", "report", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["version"], r["train_count"] + r["held_out_count"]) for r in rows] == [(4, 6)]
    assert cli_main(["--config", str(config), "rewards", "rescore"]) == 2
    (tmp_path / "broken.toml").write_text('version = "x"\nnope = 1\n')
    assert cli_main(["--config", str(config), "rewards", "rescore", "--spec", str(tmp_path / "broken.toml")]) == 2
    assert "nope" in capsys.readouterr().err


def test_a_spec_version_names_one_spec_forever(tmp_path: Path, migrated_db_url: str) -> None:
    sessions = make_session_factory(make_engine(migrated_db_url))
    original = load_spec(write_spec(tmp_path / "one.toml", "fixed-v1"))
    changed = load_spec(write_spec(tmp_path / "two.toml", "fixed-v1", '[credit]\nrule = "last_turn"\n'))
    with sessions() as db, db.begin():
        store.register_spec(db, original)
        store.register_spec(db, original)  # the same spec again: fine
    with pytest.raises(SpecError, match="already names another spec"), sessions() as db, db.begin():
        store.register_spec(db, changed)
    settings = settings_for(tmp_path, migrated_db_url, tmp_path / "two.toml")
    with pytest.raises(SpecError, match="give the changed spec a new version"):
        rewards_run(settings, threading.Event())
    with sessions() as db:
        assert db.scalar(select(func.count()).select_from(RewardVersionStats)) == 0
