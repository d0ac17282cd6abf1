"""ingest -> rewards -> trainer over a real local-log bus, a real database and the quick tiny model.

The generation events are real: token ids and logprobs come from sampling the quick model, so the
trainer's recomputed logprobs can be checked against the served ones (parity).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from flywheel.bus import DLQ_REASON, Record, dlq_topic, make_bus
from flywheel.db.models import Feedback, Generation, ScoredTrajectoryRow, SessionState, Trajectory
from flywheel.db.session import make_engine, make_session_factory, upgrade
from flywheel.events import (
    FeedbackEvent,
    GenerationEvent,
    SamplingParams,
    ScoredTrajectory,
    TrajectoryEvent,
    feedback_event_id,
    new_id,
)
from flywheel.settings import Settings, load_settings
from flywheel.weights.codec.state import state_sha256
from flywheel.weights.registry import Registry
from flywheel.weights.store import make_store
from tests.fixtures.traffic import produce, wait_for

pytestmark = pytest.mark.integration

TENANT = "acme"
N_SESSIONS = 8
#: The default reward spec without a held-out slice, so every session reaches the scored topic.
SPEC_VERSION = "pipeline-v1"


@dataclass
class Traffic:
    generations: list[GenerationEvent]
    feedback: list[FeedbackEvent]
    sessions: list[str]


@pytest.fixture(scope="module")
def traffic(tiny_model_dir: Path) -> Traffic:
    """Eight sessions served by the quick model: half solved (thumbs up), half retried then abandoned."""
    from demo.tinymodel.task import RETRY_MESSAGE, traffic_problem, user_message
    from flywheel.lm import chat_prompt_ids, completion_text, generate, load_model

    model, tok = load_model(tiny_model_dir)
    rng = random.Random(7)
    problems = [traffic_problem(rng) for _ in range(N_SESSIONS // 2)]
    problems = problems + problems  # two sessions per prompt: group-relative baselines apply
    sessions = [f"sess-{i}-{new_id()[:8]}" for i in range(N_SESSIONS)]

    def served(session_id: str, messages: list[dict], seed: int) -> GenerationEvent:
        prompt = chat_prompt_ids(tok, messages)
        sample = generate(model, [prompt], max_new_tokens=8, seed=seed, eos_token_id=tok.eos_token_id)[0]
        return GenerationEvent(
            tenant=TENANT, session_id=session_id, generation_id=new_id(), model_line="tiny-sim", model_version=0,
            node_id="node-0", request={"messages": messages},
            response={"choices": [{"message": {"role": "assistant", "content": completion_text(tok, sample.token_ids)}}]},
            prompt_token_ids=prompt, completion_token_ids=sample.token_ids, completion_logprobs=sample.logprobs,
            sampling=SamplingParams(temperature=1.0, top_p=1.0), finish_reason=sample.finish_reason, latency_ms=3.0,
        )

    def feedback(session_id: str, generation_id: str | None, kind: str, signal: str, value: float | None) -> FeedbackEvent:
        fid = new_id()
        return FeedbackEvent(event_id=feedback_event_id(TENANT, fid), tenant=TENANT, session_id=session_id,
                             feedback_id=fid, generation_id=generation_id, kind=kind, signal=signal, value=value)

    gens: list[GenerationEvent] = []
    fbs: list[FeedbackEvent] = []
    for i, (session_id, problem) in enumerate(zip(sessions, problems, strict=True)):
        messages = [{"role": "user", "content": user_message(problem)}]
        first = served(session_id, messages, seed=i)
        gens.append(first)
        if i % 2 == 0:
            fbs.append(feedback(session_id, first.generation_id, "explicit", "thumbs", 1))
            if i != 0:  # session 0 has no outcome: inactivity closes it
                fbs.append(feedback(session_id, None, "outcome", "task_solved", 1))
        else:
            fbs.append(feedback(session_id, first.generation_id, "explicit", "thumbs", -1))
            fbs.append(feedback(session_id, first.generation_id, "implicit", "retry", None))
            answer = first.response["choices"][0]["message"]["content"]
            again = messages + [{"role": "assistant", "content": answer}, {"role": "user", "content": RETRY_MESSAGE}]
            second = served(session_id, again, seed=100 + i)
            gens.append(second)
            fbs.append(feedback(session_id, second.generation_id, "implicit", "abandon", None))
    return Traffic(gens, fbs, sessions)


def make_settings(data_dir: Path, db_url: str, model_dir: Path, **overrides: Any) -> Settings:
    data_dir.mkdir(parents=True, exist_ok=True)
    spec = data_dir / "rewards.toml"
    spec.write_text(f'extends = "default"\nversion = "{SPEC_VERSION}"\n[guards]\nheld_out_fraction = 0.0\n')
    base: dict[str, Any] = {
        "rewards": {"spec_path": str(spec)},
        "data_dir": str(data_dir),
        "db": {"url": db_url, "wait_s": 10},
        "model": {"path": str(model_dir)},
        "bus": {"partitions": 2},
        "ingest": {"inactivity_timeout_s": 1.0},
        "trainer": {"batch_size": 4, "steps_per_version": 2, "lr": 1e-3},
    }
    for section, values in overrides.items():
        base[section] = {**base.get(section, {}), **values} if isinstance(values, dict) else values
    return load_settings(None, **base)


class _Started(logging.Handler):
    """Sees each role's start-up line (logged once its database upgrade and bus set-up are done)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if record.name in ("flywheel.ingest", "flywheel.rewards", "flywheel.trainer") and record.levelno == logging.INFO:
            self.count += 1 if record.getMessage().startswith(("ingest consuming", "rewards scoring", "training ")) else 0


@contextmanager
def running(*roles: Callable[..., None], settings: Settings) -> Iterator[None]:
    """Run role entry points in threads; stop them and surface their errors on exit.

    Roles start one after another: each runs the Alembic upgrade at start-up, and Alembic's
    migration context is process-global, so two upgrades in threads of one process collide
    (separate processes, as ``flywheel up`` runs them, are fine).
    """
    stop = threading.Event()
    errors: list[BaseException] = []
    started = _Started()
    logger = logging.getLogger("flywheel")
    logger.addHandler(started)
    old_level = logger.level
    logger.setLevel(logging.INFO)

    def target(role: Callable[..., None]) -> None:
        try:
            role(settings, stop)
        except BaseException as exc:  # reported below, in the test thread
            errors.append(exc)

    threads: list[threading.Thread] = []
    try:
        for i, role in enumerate(roles):
            threads.append(threading.Thread(target=target, args=(role,), daemon=True))
            threads[-1].start()
            wait_for(f"{role.__module__} to start", lambda: started.count > i or bool(errors), timeout_s=120)
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
        logger.removeHandler(started)
        logger.setLevel(old_level)
        assert not [t for t in threads if t.is_alive()], "a role did not stop within 60s"
        if errors:
            raise errors[0]


def read_all(settings: Settings, topic: str, group: str, *, at_least: int, timeout_s: float = 30.0) -> list[Record]:
    bus = make_bus(settings)
    consumer = bus.consumer(group, [topic])
    out: list[Record] = []
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            out += consumer.poll(timeout_s=0.3, max_records=500)
            if len(out) >= at_least:
                out += consumer.poll(timeout_s=0.3, max_records=500)  # and nothing unexpected after
                break
    finally:
        consumer.close()
        bus.close()
    return out


def count(sessions: Any, model: Any, *where: Any) -> int:
    with sessions() as db:
        return db.scalar(select(func.count()).select_from(model).where(*where)) or 0


def send_twice(settings: Settings, traffic: Traffic) -> None:
    bus = make_bus(settings)
    producer = bus.producer()
    for _ in range(2):  # every event delivered twice: the pipeline must not double count
        for g in traffic.generations:
            producer.send(settings.topic("generations"), g.session_id, g.to_bytes())
        for f in traffic.feedback:
            producer.send(settings.topic("feedback"), f.session_id, f.to_bytes())
    producer.flush()
    producer.close()
    bus.close()


def test_ingest_and_rewards_persist_once_score_and_dead_letter(
    tmp_path: Path, migrated_db_url: str, tiny_model_dir: Path, traffic: Traffic
) -> None:
    from ingest.worker import run as ingest_run
    from rewards.worker import run as rewards_run

    settings = make_settings(tmp_path, migrated_db_url, tiny_model_dir)
    sessions = make_session_factory(make_engine(migrated_db_url))
    bus = make_bus(settings)
    bus.ensure_topics([settings.topic(t) for t in ("generations", "feedback", "trajectories", "scored")])
    producer = bus.producer()
    producer.send(settings.topic("generations"), "bad-1", b"\xff\xfe not json")
    producer.send(settings.topic("feedback"), "bad-2", b'{"tenant": "acme", "session_id": "x", "kind": "outcome"}')
    producer.flush()
    send_twice(settings, traffic)

    with running(ingest_run, rewards_run, settings=settings):
        wait_for("every session scored", lambda: count(sessions, ScoredTrajectoryRow) >= N_SESSIONS)
        time.sleep(1.5)  # long enough for a wrongly duplicated close or score to show up

    assert count(sessions, Generation) == len(traffic.generations)
    assert count(sessions, Feedback) == len(traffic.feedback)
    assert count(sessions, Feedback, Feedback.state == "joined") == len(traffic.feedback)
    assert count(sessions, Trajectory) == N_SESSIONS
    assert count(sessions, ScoredTrajectoryRow) == N_SESSIONS
    assert count(sessions, SessionState, SessionState.status == "closed") == N_SESSIONS
    with sessions() as db:
        reasons = dict(db.execute(select(Trajectory.session_id, Trajectory.closed_reason)).all())
    assert reasons[traffic.sessions[0]] == "inactivity"
    assert all(reasons[s] == "outcome" for s in traffic.sessions[1:])

    trajectories = read_all(settings, settings.topic("trajectories"), "t-traj", at_least=N_SESSIONS)
    decoded = {TrajectoryEvent.from_bytes(r.value).event_id: TrajectoryEvent.from_bytes(r.value) for r in trajectories}
    assert len(decoded) == N_SESSIONS and {t.session_id for t in decoded.values()} == set(traffic.sessions)
    by_session = {t.session_id: t for t in decoded.values()}
    for g in traffic.generations:  # the served tokens and logprobs are in the trajectory, mask 1, unchanged
        turns = [(seg, turn) for seg in by_session[g.session_id].segments for turn in seg.turns
                 if turn.generation_id == g.generation_id]
        assert len(turns) == 1
        seg, turn = turns[0]
        assert seg.tokens[turn.start : turn.end] == g.completion_token_ids
        assert seg.logprobs[turn.start : turn.end] == g.completion_logprobs
        assert set(seg.mask[turn.start : turn.end]) <= {1}

    scored_records = read_all(settings, settings.topic("scored"), "t-scored", at_least=N_SESSIONS)
    scored = {ScoredTrajectory.from_bytes(r.value).event_id: ScoredTrajectory.from_bytes(r.value) for r in scored_records}
    assert len(scored) == N_SESSIONS
    assert {s.reward_spec_version for s in scored.values()} == {SPEC_VERSION}
    assert all(s.turn_advantages is not None and not s.held_out for s in scored.values())
    totals = {s.session_id: s.total_reward for s in scored.values()}
    # solved: thumbs up 1 + task_solved 1; inactivity: thumbs up only;
    # failed: turn 1 thumbs down -1, retry -0.5; turn 2 abandon -0.5.
    assert totals[traffic.sessions[0]] == 1.0
    assert all(totals[s] == 2.0 for s in traffic.sessions[2::2])
    assert all(totals[s] == -2.0 for s in traffic.sessions[1::2])

    dead_gen = read_all(settings, dlq_topic(settings.topic("generations")), "t-dlq", at_least=1)
    dead_fb = read_all(settings, dlq_topic(settings.topic("feedback")), "t-dlq", at_least=1)
    assert [r.value for r in dead_gen] == [b"\xff\xfe not json"]
    assert [r.key for r in dead_fb] == ["bad-2"]
    assert "GenerationEvent" in dead_gen[0].headers[DLQ_REASON]
    assert "FeedbackEvent" in dead_fb[0].headers[DLQ_REASON]
    bus.close()


def test_late_feedback_reopens_within_the_horizon_and_expires_after(
    tmp_path: Path, sqlite_url: str, tiny_model_dir: Path, traffic: Traffic
) -> None:
    from ingest.worker import run as ingest_run

    upgrade(sqlite_url)
    settings = make_settings(tmp_path, sqlite_url, tiny_model_dir)
    sessions = make_session_factory(make_engine(sqlite_url))
    send_twice(settings, traffic)
    solved = traffic.sessions[2]
    with running(ingest_run, settings=settings):
        wait_for("sessions closed", lambda: count(sessions, SessionState, SessionState.status == "closed") == N_SESSIONS)
        late = FeedbackEvent(tenant=TENANT, session_id=solved, feedback_id="late-1", kind="explicit", signal="rating",
                             value=5, event_id=feedback_event_id(TENANT, "late-1"))
        send_feedback(settings, late, late)
        wait_for("revision 1", lambda: count(sessions, Trajectory, Trajectory.session_id == solved) == 2)

    # Restarted with no horizon: the next late feedback is stored as expired, nothing re-emitted.
    expired_settings = make_settings(tmp_path, sqlite_url, tiny_model_dir, ingest={"late_horizon_s": 0.0})
    with running(ingest_run, settings=expired_settings):
        too_late = FeedbackEvent(tenant=TENANT, session_id=solved, feedback_id="late-2", kind="explicit",
                                 signal="thumbs", value=1, ts=datetime.now(UTC), event_id=feedback_event_id(TENANT, "late-2"))
        time.sleep(0.05)
        send_feedback(settings, too_late)
        wait_for("expired feedback", lambda: count(sessions, Feedback, Feedback.state == "expired") == 1)
        time.sleep(1.0)

    with sessions() as db:
        rows = db.execute(select(Trajectory).where(Trajectory.session_id == solved).order_by(Trajectory.revision)).scalars().all()
        state = db.get(SessionState, (TENANT, solved))
    assert [(r.revision, r.closed_reason) for r in rows] == [(0, "outcome"), (1, "late_feedback")]
    assert "late-1" in {f["feedback_id"] for f in rows[1].payload["feedback"]}
    assert state is not None and state.status == "closed" and state.revision == 1
    emitted = read_all(settings, settings.topic("trajectories"), "t-late", at_least=N_SESSIONS + 1)
    revisions = {(t.session_id, t.revision) for t in map(lambda r: TrajectoryEvent.from_bytes(r.value), emitted)}
    assert (solved, 1) in revisions and (solved, 2) not in revisions and len(revisions) == N_SESSIONS + 1


def send_feedback(settings: Settings, *events: FeedbackEvent) -> None:
    bus = make_bus(settings)
    producer = bus.producer()
    for e in events:
        producer.send(settings.topic("feedback"), e.session_id, e.to_bytes())
    producer.flush()
    producer.close()
    bus.close()


def registry_for(settings: Settings) -> Registry:
    """The line's registry, with the base model registered as stable v0 (what the node does at start)."""
    from flywheel.lm import export_state, load_model

    engine = make_engine(settings.database_url)
    registry = Registry(make_session_factory(engine), make_store(settings), settings.model.line)
    registry.ensure_base(export_state(load_model(settings.model.path)[0]), reason="test: base model")
    return registry


def test_trainer_publishes_a_delta_and_lr_zero_changes_nothing(
    tmp_path: Path, sqlite_url: str, tiny_model_dir: Path, traffic: Traffic
) -> None:
    from ingest.worker import run as ingest_run
    from rewards.worker import run as rewards_run
    from trainer.train import train

    upgrade(sqlite_url)
    settings = make_settings(tmp_path / "a", sqlite_url, tiny_model_dir)
    sessions = make_session_factory(make_engine(sqlite_url))
    send_twice(settings, traffic)
    with running(ingest_run, rewards_run, settings=settings):
        wait_for("every session scored", lambda: count(sessions, ScoredTrajectoryRow) >= N_SESSIONS)
    scored = read_all(settings, settings.topic("scored"), "t-copy", at_least=N_SESSIONS)

    registry = registry_for(settings)
    with running(train, settings=settings):
        wait_for("version 1", lambda: (registry.latest() or registry).__dict__.get("version", -1) >= 1, timeout_s=180)
    v0, v1 = registry.get(0), registry.get(1)
    assert (v0.kind, v1.kind, v1.parent) == ("full", "delta", 0)
    assert v1.bytes < v1.full_bytes
    assert v1.train_step == 2 and v1.metrics["steps"] == 2 and v1.metrics["samples"] == 8
    w0, w1 = registry.load(0), registry.load(1)
    assert state_sha256(w1) == v1.sha256 != v0.sha256 == state_sha256(w0)
    assert any(not (w0[k] == w1[k]).all() for k in w0)
    assert v1.metrics["parity"] < 1e-3  # served logprobs of v0 == the trainer's at the first step

    # The control run: the same scored samples, a fresh registry, lr = 0.
    control = make_settings(tmp_path / "b", f"sqlite:///{tmp_path / 'b.db'}", tiny_model_dir,
                            trainer={"lr": 0.0, "require_stored": False})  # scored rows live in the first database
    upgrade(control.database_url)
    produce(control, [], raw=[("scored", record.key or "", record.value) for record in scored])
    control_registry = registry_for(control)
    with running(train, settings=control):
        wait_for("control version 1", lambda: len(control_registry.versions()) >= 2, timeout_s=180)
    c0, c1 = control_registry.get(0), control_registry.get(1)
    assert c0.sha256 == v0.sha256  # both seeded from the same base model
    assert c1.sha256 == c0.sha256 == state_sha256(control_registry.load(1))
    assert c1.metrics["parity"] < 1e-3


class _DiesOnSend:
    """A producer that fails like a broker outage: after the DB commit, before anything is on the bus."""

    def send(self, topic: str, key: str, value: bytes, headers: dict[str, str] | None = None) -> None:
        raise ConnectionError("broker unreachable")

    def flush(self, timeout_s: float | None = None) -> None:
        raise ConnectionError("broker unreachable")

    def close(self) -> None:
        pass


def test_a_trajectory_committed_but_not_produced_is_emitted_on_the_next_pass(
    tmp_path: Path, sqlite_url: str, tiny_model_dir: Path, traffic: Traffic
) -> None:
    from ingest.worker import Ingestor

    upgrade(sqlite_url)
    settings = make_settings(tmp_path, sqlite_url, tiny_model_dir)
    sessions = make_session_factory(make_engine(sqlite_url))
    send_twice(settings, traffic)
    bus = make_bus(settings)
    consumer = bus.consumer("ingest", [settings.topic("generations"), settings.topic("feedback")])
    records: list[Record] = []
    deadline = time.monotonic() + 30
    while len(records) < 2 * (len(traffic.generations) + len(traffic.feedback)) and time.monotonic() < deadline:
        records += consumer.poll(timeout_s=0.3, max_records=500)

    crashed = Ingestor(settings, sessions, _DiesOnSend())
    with pytest.raises(ConnectionError):
        crashed.process(records, consumer)  # the DB commit happened; the produce failed; offsets never committed
    closing = count(sessions, SessionState, SessionState.status == "closing")
    assert closing == N_SESSIONS - 1  # every outcome-closed session (session 0 waits for inactivity)
    assert count(sessions, Trajectory) == closing

    producer = bus.producer()
    restarted = Ingestor(settings, sessions, producer)
    assert restarted.emit_pending() == closing  # the restart's first pass
    assert restarted.emit_pending() == 0
    restarted.process(records, consumer)  # the uncommitted batch is delivered again: a no-op
    assert count(sessions, SessionState, SessionState.status == "closed") == closing
    assert count(sessions, Trajectory) == closing
    emitted = read_all(settings, settings.topic("trajectories"), "t-outbox", at_least=closing)
    assert len(emitted) == closing
    assert len({TrajectoryEvent.from_bytes(r.value).event_id for r in emitted}) == closing
    consumer.close()
    producer.close()
    bus.close()
