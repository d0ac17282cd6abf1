"""Ingest (and rewards) worker processes in one consumer group: rebalances and kill -9, exactly once.

Every worker here is a real ``python -m launch.cli ingest`` (or ``rewards``) process over the
same database and bus: a Kafka-protocol broker (Tansu) with PostgreSQL, and the embedded
deployment, the local log with SQLite. (The bus and the database do not meet in these scenarios,
so the other two combinations would prove nothing more; test_ingest_order runs one ingestor on
both databases and both buses.) Kafka groups use short session timeouts (``FAST_KAFKA_GROUPS``):
a join takes about a second, and a killed member is out of the group a second after its death
instead of holding up the next join for six.

The checks are ``tests.fixtures.traffic.check_pipeline``'s: every event stored once, every session
closed with revisions 0..k stored once each (the newest holding every turn and every kept
feedback), every stored revision on the bus and nothing else; after a graceful stop nothing is on
the bus twice, after a kill -9 a redelivery is allowed only byte for byte.

A kill is aimed at the middle of a batch: the test waits until the database shows a write
transaction in progress (PostgreSQL: a worker's backend ``active`` or ``idle in transaction`` for
more than a few milliseconds; SQLite: the write lock is held) and kills every worker at once.
"""

from __future__ import annotations

import ast
import random
import re
import signal
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

from flywheel.db.models import Feedback, Generation
from flywheel.db.session import make_engine, upgrade
from flywheel.events import GenerationEvent
from flywheel.settings import Settings, load_settings
from testbed.broker import start_tansu
from tests.fixtures.kafka import kafka_test_settings, local_test_settings
from tests.fixtures.traffic import (
    FAST_KAFKA_GROUPS,
    RoleProcess,
    SessionTraffic,
    check_pipeline,
    count,
    make_traffic,
    produce,
    read_topic,
    scored_on_bus,
    settled,
    stored,
    wait_for,
    write_config,
)

pytestmark = pytest.mark.integration


VARIANTS = ["kafka-postgresql", "local-sqlite"]
INGEST = {"inactivity_timeout_s": 3.0, "orphan_timeout_s": 60.0}


def stack_settings(request: pytest.FixtureRequest, tmp_path: Path, bootstrap: str | None = None) -> Settings:
    """The settings of ``request.param`` ("bus-database"), migrated; Kafka on ``bootstrap`` (default:
    the session's broker) with ``FAST_KAFKA_GROUPS``."""
    bus_kind, db = request.param.split("-")
    db_url = request.getfixturevalue("pg_url" if db == "postgresql" else "sqlite_url")
    upgrade(db_url)
    if bus_kind == "kafka":
        bus = kafka_test_settings(bootstrap or request.getfixturevalue("kafka_bootstrap"), tmp_path, bus=FAST_KAFKA_GROUPS)
    else:
        bus = local_test_settings(tmp_path)
    return load_settings(None, **{**bus.model_dump(mode="json"), "log_level": "INFO",
                                  "db": {"url": db_url, "wait_s": 30}, "ingest": INGEST})


@pytest.fixture(params=VARIANTS)
def stack(request: pytest.FixtureRequest, tmp_path: Path) -> Settings:
    return stack_settings(request, tmp_path)


class Workers:
    """The ingest processes of one test; each is stopped (or killed) at the end."""

    def __init__(self, settings: Settings, tmp_path: Path, role: str = "ingest") -> None:
        self.config = write_config(tmp_path / f"{role}.json", settings)
        self.log_dir = tmp_path
        self.role = role
        self.started: list[RoleProcess] = []

    def start(self, name: str) -> RoleProcess:
        process = RoleProcess(self.role, self.config, self.log_dir, name).start()
        self.started.append(process)
        return process

    @property
    def alive(self) -> list[RoleProcess]:
        return [p for p in self.started if p.alive]

    def check_alive(self) -> None:
        for p in self.started:
            if p.process is not None and p.process.poll() not in (None, 0, -9):
                raise AssertionError(f"{p.name} exited {p.process.returncode}:\n{p.log_tail()}")

    def close(self) -> None:
        for p in self.started:
            if p.alive:
                p.process.kill()  # type: ignore[union-attr]

    @contextmanager
    def paused(self, settings: Settings) -> Iterator[None]:
        """On the local log, the live workers stopped (SIGSTOP) for the block and continued after.

        There a worker reads each record the moment it is written and keeps pace with the
        producer, so without a pause a round's backlog would be gone by the time the kill is
        aimed; paused, the workers meet the whole backlog at once. (Not on Kafka: a stopped member
        misses its heartbeats and is evicted; there the producer outpaces the workers anyway.)
        """
        paused = [p for p in self.alive if settings.bus.kind == "local"]
        for p in paused:
            p.process.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
        try:
            yield
        finally:
            for p in paused:
                p.process.send_signal(signal.SIGCONT)  # type: ignore[union-attr]


@pytest.fixture
def workers(stack: Settings, tmp_path: Path) -> Iterator[Workers]:
    w = Workers(stack, tmp_path)
    yield w
    w.close()


def start_owning(workers: Workers, name: str) -> RoleProcess:
    """Start an ingest worker and wait until it owns partitions (it logs each new assignment).

    One at a time: Tansu can leave a Kafka group stuck when two members join at the same instant.
    """
    process = workers.start(name)

    def owns() -> bool:
        workers.check_alive()
        lines = re.findall(r"ingest owns (.*)", process.log_path.read_text())
        return bool(lines) and lines[-1] != "no partition"

    wait_for(f"{name} to own partitions", owns, 120, every_s=0.05)
    return process


def stopped_counters(process: RoleProcess) -> dict[str, int]:
    """The counters a worker logs when it stops gracefully."""
    found = re.findall(rf"{process.role} stopping: (\{{.*\}})", process.log_path.read_text())
    assert found, f"{process.name} logged no counters:\n{process.log_tail()}"
    return ast.literal_eval(found[-1])


def phases_of(traffic: list[SessionTraffic], n: int) -> list[list[Any]]:
    """Each session's events cut into ``n`` consecutive parts: every session straddles every phase."""
    phases: list[list[Any]] = [[] for _ in range(n)]
    for session in traffic:
        events = session.events
        for i in range(n):
            phases[i] += events[i * len(events) // n : (i + 1) * len(events) // n]
    return phases


def test_workers_joining_and_leaving_mid_run_persist_and_emit_exactly_once(stack: Settings, workers: Workers) -> None:
    # Served over the last few seconds: a session idle for the inactivity timeout closes while
    # its next phase is still to come (and re-opens then), and none keeps the end waiting.
    traffic = make_traffic(300, seed=11, turns=(2, 4), start=datetime.now(UTC) - timedelta(seconds=5))
    phases = phases_of(traffic, 4)
    engine = make_engine(stack.database_url)

    def ingested(phase: list[Any]) -> bool:
        workers.check_alive()
        gens = [e.event_id for e in phase if isinstance(e, GenerationEvent)]
        fbs = [e.event_id for e in phase if not isinstance(e, GenerationEvent)]
        return stored(engine, Generation, gens) == len(gens) and stored(engine, Feedback, fbs) == len(fbs)

    try:
        a = start_owning(workers, "ingest-a")
        produce(stack, phases[0])
        wait_for("a to ingest", lambda: workers.check_alive() or count(engine, Generation) > 0, every_s=0.05)
        b = start_owning(workers, "ingest-b")  # joins mid-run: the group rebalances
        produce(stack, phases[1])
        c = start_owning(workers, "ingest-c")
        # Three workers: a session's generations and its feedback may be on two of them, and this
        # phase goes out under another key, as if the topic had been repartitioned: the session's
        # newer events land on another partition, often another worker's.
        produce(stack, phases[2], key=lambda e: f"{e.session_id}/moved")
        wait_for("the third phase stored", lambda: ingested(phases[2]), every_s=0.05)
        a.stop()  # leaves mid-run, its sessions still open: its partitions move to b and c
        produce(stack, phases[3])
        wait_for("every session closed and emitted", lambda: workers.check_alive() or settled(engine, traffic), 180,
                 every_s=0.1)
        time.sleep(1.0)  # long enough for a wrongly repeated close or emission to show up
        b.stop()
        c.stop()
    finally:
        engine.dispose()
    checked = check_pipeline(stack, traffic)
    ingested_by = {p.name: stopped_counters(p).get("generations", 0) for p in (a, b, c)}
    assert ingested_by["ingest-a"] > 0 and ingested_by["ingest-b"] > 0 and ingested_by["ingest-c"] > 0, ingested_by
    assert sum(ingested_by.values()) == sum(len(s.generations) for s in traffic)
    assert checked.bus_redelivered == 0


class WriteProbe:
    """Sees a worker's batch transaction in progress, so a kill lands in the middle of a batch.

    PostgreSQL: a backend of the test database ``active`` or ``idle in transaction`` in a
    transaction older than 20 ms. SQLite: the write lock held at two looks 15 ms apart. (An idle
    ingest worker's outbox claim holds either for a millisecond or two; a batch for much longer.)
    With ``idle_writes=False`` (rewards workers, which write only to store a batch) any write
    transaction is a batch's: one look, no minimum age, so short batches are seen too.
    """

    def __init__(self, url: str, *, idle_writes: bool = True) -> None:
        parsed = make_url(url)
        self.sqlite_path = parsed.database if parsed.get_backend_name() == "sqlite" else None
        self.engine = None if self.sqlite_path else make_engine(url)
        self.min_age_ms = 20 if idle_writes else 0

    def writing(self) -> bool:
        if self.sqlite_path is not None:
            if not self._sqlite_locked():
                return False
            return not self.min_age_ms or (time.sleep(0.015) or self._sqlite_locked())
        assert self.engine is not None
        with self.engine.connect() as conn:
            return bool(conn.scalar(text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid() AND state IN ('active', 'idle in transaction') "
                "AND clock_timestamp() - xact_start >= make_interval(secs => :age)"), {"age": self.min_age_ms / 1000}))

    def _sqlite_locked(self) -> bool:
        conn = sqlite3.connect(self.sqlite_path, timeout=0, isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("ROLLBACK")
            return False
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc) or "busy" in str(exc):
                return True
            raise
        finally:
            conn.close()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.dispose()


def kill_mid_batch(workers: Workers, probe: WriteProbe, backlog: Callable[[], int], rng: random.Random,
                   max_delay_s: float) -> int:
    """At a random moment (up to ``max_delay_s`` from now, then the next write the probe sees)
    while a batch transaction is open and events still wait, kill -9 every worker; returns how
    many were still waiting (``backlog()`` after the kill)."""
    time.sleep(rng.uniform(0.0, max_delay_s))
    deadline = time.monotonic() + 120
    while not probe.writing():
        workers.check_alive()
        assert backlog() > 0, "the workers caught up before a kill could land in the middle of a batch"
        assert time.monotonic() < deadline, "no batch transaction seen in 120 s"
        time.sleep(0.002)
    for process in workers.alive:
        process.kill()
    return backlog()


#: Sessions in the kill test: four rounds of about 1,900 events each (2,500 on the bus with the
#: feedback): each worker's share is several 500-record batches, so the kill finds a backlog left.
KILL_SESSIONS = 3000


def test_kill_9_ingest_workers_mid_batch_and_restart(stack: Settings, workers: Workers) -> None:
    rng = random.Random(12)
    traffic = make_traffic(KILL_SESSIONS, seed=12)
    parts = phases_of(traffic, 4)
    engine = make_engine(stack.database_url)
    probe = WriteProbe(stack.database_url)
    left = []
    try:
        produced = 0
        for round_, part in enumerate(parts):
            start_owning(workers, f"ingest-{round_}-a")
            start_owning(workers, f"ingest-{round_}-b")
            with workers.paused(stack):
                produce(stack, part)  # a large backlog each round
            produced += sum(isinstance(e, GenerationEvent) for e in part)
            if round_ < 3:  # killed in the middle of it, three times; the last pair finishes the work
                left.append(kill_mid_batch(workers, probe, lambda: produced - count(engine, Generation), rng,
                                           max_delay_s=0.15))
        wait_for("every session closed and emitted", lambda: workers.check_alive() or settled(engine, traffic), 240,
                 every_s=0.1)
        for process in workers.alive:
            process.stop()
    finally:
        probe.close()
        engine.dispose()
    checked = check_pipeline(stack, traffic, allow_redelivery=True)
    print(f"kill -9 of both workers x3 mid-batch ({left} generations still waiting at each kill): "
          f"{sum(checked.revisions.values())} revisions stored and emitted, "
          f"{checked.bus_redelivered} byte-identical redeliveries")


@pytest.fixture(params=VARIANTS)
def rewards_stack(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Settings]:
    """A stack for the rewards kill test. Its Kafka broker is its own: the rewards consumer group
    has a fixed name, and a group whose members were killed must not be met by a later test."""
    broker = start_tansu(log_dir=tmp_path) if request.param.startswith("kafka") else None
    try:
        yield stack_settings(request, tmp_path, broker.bootstrap if broker else None)
    finally:
        if broker is not None:
            broker.stop()


#: Sessions in the rewards kill test (one or two turns: about one trajectory each), in four
#: rounds: each round's backlog is several 200-record batches for each worker.
REWARDS_SESSIONS = 4000
#: How long a Kafka join takes with ``FAST_KAFKA_GROUPS`` (about 1 s), with a margin: a rewards
#: worker does not log its assignment, so the second one starts this long after the first.
JOIN_S = 1.5


def test_kill_9_rewards_workers_mid_batch_and_restart(rewards_stack: Settings, tmp_path: Path) -> None:
    """``flywheel rewards`` processes killed in the middle of a batch (three times, with a fresh
    backlog of trajectories each time), restarted: every stored trajectory revision is scored once
    under the spec version, every score not held out is on the scored topic (redeliveries byte
    for byte the stored score), and nothing else is."""
    from sqlalchemy import select

    from flywheel.bus import make_bus
    from flywheel.db.models import ScoredTrajectoryRow, Trajectory

    settings = rewards_stack
    rng = random.Random(13)
    traffic = make_traffic(REWARDS_SESSIONS, seed=13, start=datetime.now(UTC) - timedelta(hours=1), turns=(1, 2))
    rounds = phases_of_sessions(traffic, 4)
    # The real ingest builds every trajectory first (same database; its own bus, the local log),
    # and each round's are copied onto the rewards workers' topic in one burst once both are up.
    staged = build_trajectories(settings, traffic, tmp_path / "staging")
    engine = make_engine(settings.database_url)
    assert len(staged) == count(engine, Trajectory)
    probe = WriteProbe(settings.database_url, idle_writes=False)
    workers = Workers(settings, tmp_path, role="rewards")
    bus = make_bus(settings)
    producer = bus.producer()

    def start_pair(round_: str) -> list[RoleProcess]:
        pair = [workers.start(f"rewards-{round_}-a")]
        wait_for("a to start", lambda: workers.check_alive() or "rewards scoring" in pair[0].log_path.read_text(), 60,
                 every_s=0.05)
        if settings.bus.kind == "kafka":
            time.sleep(JOIN_S)  # one join at a time (see start_owning)
        pair.append(workers.start(f"rewards-{round_}-b"))
        wait_for("b to start", lambda: workers.check_alive() or "rewards scoring" in pair[1].log_path.read_text(), 60,
                 every_s=0.05)
        return pair

    released = 0
    left = []
    try:
        for round_, sessions in enumerate(rounds):
            pair = start_pair(str(round_) if round_ < 3 else "final")
            ids = {s.session_id for s in sessions}
            batch = [r for r in staged if r.key in ids]
            with workers.paused(settings):
                for record in batch:
                    producer.send(settings.topic("trajectories"), record.key, record.value)
                producer.flush()
            released += len(batch)
            if round_ < 3:
                # A short delay: on the local log the pair scores a round's backlog in a quarter of a second.
                left.append(kill_mid_batch(workers, probe, lambda: released - count(engine, ScoredTrajectoryRow), rng,
                                           max_delay_s=0.05))
        assert released == len(staged)
        wait_for("every trajectory scored",
                 lambda: workers.check_alive() or count(engine, ScoredTrajectoryRow) >= released, 240, every_s=0.1)
        time.sleep(1.0)
        for process in pair:
            process.stop()
        with engine.connect() as conn:
            stored = {(r.trajectory_id, r.revision) for r in conn.execute(select(Trajectory.trajectory_id, Trajectory.revision))}
            scored = conn.execute(select(ScoredTrajectoryRow.trajectory_id, ScoredTrajectoryRow.revision,
                                         ScoredTrajectoryRow.reward_spec_version, ScoredTrajectoryRow.event_id,
                                         ScoredTrajectoryRow.payload)).all()
    finally:
        producer.close()
        bus.close()
        workers.close()
        probe.close()
        engine.dispose()
    assert len({r.reward_spec_version for r in scored}) == 1
    assert sorted((r.trajectory_id, r.revision) for r in scored) == sorted(stored)  # each exactly once
    redelivered = scored_on_bus(settings, scored)
    print(f"rewards kill -9 x3 mid-batch ({left} trajectories still waiting at each kill): {len(scored)} revisions "
          f"scored once and on the bus, {redelivered} byte-identical redeliveries")


def phases_of_sessions(traffic: list[SessionTraffic], n: int) -> list[list[SessionTraffic]]:
    return [traffic[i * len(traffic) // n : (i + 1) * len(traffic) // n] for i in range(n)]


def build_trajectories(settings: Settings, traffic: list[SessionTraffic], data_dir: Path) -> list[Any]:
    """Run the real ingest (``ingest.worker.run``, in a thread) over ``traffic`` on a local log
    under ``data_dir`` and ``settings``' database until every session is closed and emitted; the
    records of its trajectories topic."""
    from ingest.worker import run

    staging = load_settings(None, **{**settings.model_dump(mode="json"),
                                     "bus": local_test_settings(data_dir).bus.model_dump(mode="json"),
                                     "data_dir": str(data_dir)})
    produce(staging, [e for s in traffic for e in s.events])
    engine = make_engine(staging.database_url)
    stop = threading.Event()
    failed: list[BaseException] = []

    def ingest() -> None:
        try:
            run(staging, stop)
        except BaseException as exc:  # noqa: BLE001 - reported by the wait below
            failed.append(exc)

    thread = threading.Thread(target=ingest, name="staging-ingest", daemon=True)
    thread.start()
    try:
        wait_for("the staged trajectories", lambda: failed or settled(engine, traffic), 120, every_s=0.1)
    finally:
        stop.set()
        thread.join(30)
        engine.dispose()
    assert not failed, failed
    return read_topic(staging, staging.topic("trajectories"))
