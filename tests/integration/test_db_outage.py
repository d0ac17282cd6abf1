"""Database outages ridden out in-process by the ingest and rewards workers, injected for real.

The fault: while a real worker process (``python -m launch.cli ingest`` or ``rewards``) is in
the middle of a batch, its PostgreSQL database stops accepting connections (``ALTER DATABASE ...
ALLOW_CONNECTIONS false``) and every backend connected to it is terminated (``pg_terminate_backend``),
for ``OUTAGE_S`` seconds; then connections are allowed again. For the worker that is what a
server restart is (its transaction dies, reconnecting is refused), while the shared server keeps
serving the other tests' databases.

Checked, on Kafka (Tansu) and on the local log: the process never exits (it is stopped with SIGTERM
at the end and exits 0); it logged the outage and the recovery; every event is stored once and
every trajectory (or score) is on the bus, a redelivery only byte for byte (as after a crash); the
consumer group did not change: on Kafka the broker lists the same single member before and after
(a member id changes on every leave or rejoin), on the local log the same member file. On Kafka the
outage lasts longer than ``max_poll_interval_ms``, so the membership survives only because the
waiting worker keeps polling.

Also here: :func:`flywheel.db.session.is_db_outage` on real errors of a real server, and
:class:`~flywheel.db.session.OutageWait` giving up.
"""

from __future__ import annotations

import re
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import Engine, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

from flywheel.db.models import Generation, ScoredTrajectoryRow
from flywheel.db.session import (
    DatabaseUnavailable,
    OutageWait,
    is_db_outage,
    make_engine,
    outage_reason,
    upgrade,
)
from flywheel.events import GenerationEvent
from flywheel.settings import Settings, load_settings
from ingest.assemble import assemble
from tests.fixtures.kafka import kafka_test_settings, local_test_settings
from tests.fixtures.traffic import (
    FAST_KAFKA_GROUPS,
    RoleProcess,
    check_pipeline,
    count,
    make_traffic,
    produce,
    scored_on_bus,
    settled,
    wait_for,
    write_config,
)

pytestmark = pytest.mark.integration

#: How long the database is unreachable: longer than ``MAX_POLL_MS``.
OUTAGE_S = 8.0
#: Kafka's ``max_poll_interval_ms`` for the workers here: a member that does not poll this long is
#: evicted (kafka-python's heartbeat thread sends LeaveGroup).
MAX_POLL_MS = 6000
#: Kafka group timings here: with ``FAST_KAFKA_GROUPS``' 1 s session, a worker's member id changed once
#: on a loaded 2-core machine (load 6.6): a heartbeat late by a second under load evicts it, so 3 s.
OUTAGE_GROUPS = {"session_timeout_ms": 3000, "heartbeat_interval_ms": 300, "max_poll_interval_ms": MAX_POLL_MS}
INGEST = {"inactivity_timeout_s": 3.0, "orphan_timeout_s": 60.0}


class Outage:
    """The test database unreachable, the server still up: new connections refused, every
    connection to it terminated; :meth:`end` allows connections again."""

    def __init__(self, admin: Engine, url: str) -> None:
        self.admin = admin
        self.name = make_url(url).database
        self.cut = False

    def begin(self) -> None:
        with self.admin.connect() as conn:
            conn.execute(text(f'ALTER DATABASE "{self.name}" ALLOW_CONNECTIONS false'))
            self.cut = True
            conn.execute(text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                              "WHERE datname = :name AND pid <> pg_backend_pid()"), {"name": self.name})

    def end(self) -> None:
        if self.cut:
            with self.admin.connect() as conn:
                conn.execute(text(f'ALTER DATABASE "{self.name}" ALLOW_CONNECTIONS true'))
            self.cut = False


@pytest.fixture
def outage(pg_admin: Engine, pg_url: str) -> Iterator[Outage]:
    cut = Outage(pg_admin, pg_url)
    yield cut
    cut.end()


def writing(engine: Engine, min_age_ms: int) -> bool:
    """A worker's transaction in progress on the test database for at least ``min_age_ms``."""
    with engine.connect() as conn:
        return bool(conn.scalar(text(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid() AND state IN ('active', 'idle in transaction') "
            "AND clock_timestamp() - xact_start >= make_interval(secs => :age)"), {"age": min_age_ms / 1000}))


def cut_mid_batch(outage: Outage, engine: Engine, backlog: Callable[[], int], total: int, min_age_ms: int) -> int:
    """Begin the outage as soon as a batch transaction is seen after some batches were stored (so
    that offsets were committed) while events still wait; returns the backlog (events not yet
    stored) at the cut."""
    deadline = time.monotonic() + 60
    while not (backlog() < total and writing(engine, min_age_ms)):
        assert backlog() > 0, "the worker caught up before the outage could land in a batch"
        assert time.monotonic() < deadline, "no batch transaction seen in 60 s"
        time.sleep(0.002)
    left = backlog()
    outage.begin()
    return left


@pytest.fixture(params=["kafka", "local"])
def outage_stack(request: pytest.FixtureRequest, tmp_path: Path, pg_url: str) -> Settings:
    """Kafka (``OUTAGE_GROUPS``) or the local log, each with PostgreSQL."""
    upgrade(pg_url)
    if request.param == "kafka":
        bus = kafka_test_settings(request.getfixturevalue("kafka_bootstrap"), tmp_path,
                                  bus={**FAST_KAFKA_GROUPS, **OUTAGE_GROUPS})
    else:
        bus = local_test_settings(tmp_path)
    return load_settings(None, **{**bus.model_dump(mode="json"), "log_level": "INFO",
                                  "db": {"url": pg_url, "wait_s": 30}, "ingest": INGEST,
                                  # the rewards test produces its trajectories itself: no ingest stored them
                                  "rewards": {"require_stored": False}})


def members(settings: Settings, stage: str) -> list[str]:
    """The members of ``stage``'s consumer group now: Kafka member ids (from the broker), or the
    local log's live member files."""
    group = settings.group(stage)
    if settings.bus.kind == "local":
        return sorted(p.name for p in (settings.bus_log_path / "groups" / group / "members").glob("*.member"))
    from kafka import KafkaAdminClient

    class Admin(KafkaAdminClient):
        def _process_acl_operations(self, obj: dict) -> dict:
            # Tansu 0.6 answers DescribeGroups with authorized operations kafka-python cannot name
            # (ValueError: 15 is not a valid ACLOperation); the members are all this needs.
            obj.pop("authorized_operations", None)
            return obj

    admin = Admin(bootstrap_servers=settings.bus.bootstrap_servers, request_timeout_ms=5000)
    try:
        described = admin.describe_groups([group])[group]
    finally:
        admin.close()
    return sorted(m["member_id"] for m in described["members"])


def one_member(settings: Settings, stage: str, process: RoleProcess) -> list[str]:
    def single() -> list[str] | None:
        assert process.alive, f"{process.name} exited:\n{process.log_tail()}"
        found = members(settings, stage)
        return found if len(found) == 1 else None

    return wait_for(f"{process.name} to be the one member of its group", single, 60, every_s=0.1)


def outage_logged(process: RoleProcess) -> tuple[int, int]:
    log = process.log_path.read_text()
    return log.count("database unreachable"), log.count("database back after")


def stopped_counters(process: RoleProcess) -> str:
    found = re.findall(rf"{process.role} stopping: (\{{.*\}})", process.log_path.read_text())
    assert found, f"{process.name} logged no counters:\n{process.log_tail()}"
    return found[-1]


def test_ingest_rides_out_a_database_outage_in_its_group(outage_stack: Settings, outage: Outage,
                                                         tmp_path: Path) -> None:
    settings = outage_stack
    traffic = make_traffic(600, seed=21, turns=(1, 3), start=datetime.now(UTC) - timedelta(seconds=5))
    events = [e for s in traffic for e in s.events]
    gens = sum(isinstance(e, GenerationEvent) for e in events)
    engine = make_engine(settings.database_url)
    worker = RoleProcess("ingest", write_config(tmp_path / "ingest.json", settings), tmp_path, "ingest-1").start()
    try:
        wait_for("the worker to own partitions", lambda: (worker.alive or pytest.fail(worker.log_tail()))
                 and re.search(r"ingest owns \w", worker.log_path.read_text()), 60, every_s=0.05)
        before = one_member(settings, "ingest", worker)
        produce(settings, events)
        left = cut_mid_batch(outage, engine, lambda: gens - count(engine, Generation), gens, min_age_ms=20)
        time.sleep(OUTAGE_S)
        assert worker.alive, f"the worker exited during the outage:\n{worker.log_tail()}"
        outage.end()
        wait_for("every session closed and emitted",
                 lambda: (worker.alive or pytest.fail(worker.log_tail())) and settled(engine, traffic), 60, every_s=0.1)
        time.sleep(1.0)  # long enough for a wrongly repeated emission to show up
        after = members(settings, "ingest")
        worker.stop()
    finally:
        outage.end()
        engine.dispose()
        if worker.alive:
            worker.process.kill()  # type: ignore[union-attr]
    assert after == before, f"the consumer group changed: {before} -> {after}"
    assert len(re.findall(r"ingest owns ", worker.log_path.read_text())) == 1, "the assignment changed"
    unreachable, back = outage_logged(worker)
    assert unreachable >= 1 and back == unreachable, worker.log_tail()
    assert "'db_outages'" in stopped_counters(worker)
    checked = check_pipeline(settings, traffic, allow_redelivery=True)
    print(f"ingest: outage of {OUTAGE_S:g}s cut a batch with {left} of {gens} generations waiting; "
          f"{sum(checked.revisions.values())} revisions stored and emitted, {checked.bus_redelivered} redelivered")


def test_rewards_rides_out_a_database_outage_in_its_group(outage_stack: Settings, outage: Outage,
                                                          tmp_path: Path) -> None:
    settings = outage_stack
    traffic = make_traffic(1500, seed=22, turns=(1, 2), start=datetime.now(UTC) - timedelta(hours=1))
    trajectories = [assemble(s.tenant, s.session_id, s.generations, s.feedback,
                             closed_reason="outcome" if s.feedback and s.feedback[-1].kind == "outcome" else "inactivity")
                    for s in traffic]
    engine = make_engine(settings.database_url)
    worker = RoleProcess("rewards", write_config(tmp_path / "rewards.json", settings), tmp_path, "rewards-1").start()
    try:
        wait_for("the worker to start", lambda: (worker.alive or pytest.fail(worker.log_tail()))
                 and "rewards scoring" in worker.log_path.read_text(), 60, every_s=0.05)
        before = one_member(settings, "rewards", worker)
        produce(settings, [], raw=[("trajectories", t.session_id, t.to_bytes()) for t in trajectories])
        left = cut_mid_batch(outage, engine, lambda: len(trajectories) - count(engine, ScoredTrajectoryRow),
                             len(trajectories), min_age_ms=0)
        time.sleep(OUTAGE_S)
        assert worker.alive, f"the worker exited during the outage:\n{worker.log_tail()}"
        outage.end()
        wait_for("every trajectory scored", lambda: (worker.alive or pytest.fail(worker.log_tail()))
                 and count(engine, ScoredTrajectoryRow) >= len(trajectories), 60, every_s=0.1)
        time.sleep(1.0)
        after = members(settings, "rewards")
        worker.stop()
        with engine.connect() as conn:
            scored = conn.execute(select(ScoredTrajectoryRow.trajectory_id, ScoredTrajectoryRow.event_id,
                                         ScoredTrajectoryRow.payload)).all()
    finally:
        outage.end()
        engine.dispose()
        if worker.alive:
            worker.process.kill()  # type: ignore[union-attr]
    assert after == before, f"the consumer group changed: {before} -> {after}"
    unreachable, back = outage_logged(worker)
    assert unreachable >= 1 and back == unreachable, worker.log_tail()
    assert sorted(r.trajectory_id for r in scored) == sorted(t.trajectory_id for t in trajectories)  # each once
    redelivered = scored_on_bus(settings, scored)
    print(f"rewards: outage of {OUTAGE_S:g}s cut a batch with {left} of {len(trajectories)} trajectories waiting; "
          f"{len(scored)} scored once, {redelivered} byte-identical redeliveries")


# --- the classification and the wait, on real errors ---------------------------------------------


def _error(engine: Engine, sql: str) -> DBAPIError:
    with pytest.raises(DBAPIError) as caught, engine.connect() as conn:
        conn.execute(text(sql))
    return caught.value


def test_is_db_outage_on_real_errors(pg_url: str, outage: Outage, tmp_path: Path) -> None:
    engine = make_engine(pg_url)
    try:
        # Refused by the database, not an outage: these would fail again at once.
        timeout = _error(engine, "SET LOCAL statement_timeout = 1; SELECT pg_sleep(1)")  # 57014, an OperationalError
        assert not is_db_outage(timeout), timeout
        assert not is_db_outage(_error(engine, "SELECT * FROM no_such_table"))
        held = engine.connect()
        held.execute(text("SELECT 1"))
        outage.begin()
        with pytest.raises(DBAPIError) as caught:
            held.execute(text("SELECT 1"))  # its backend was terminated
        dropped = caught.value
        held.close()
        refused = _error(engine, "SELECT 1")  # "not currently accepting connections"
        outage.end()
    finally:
        engine.dispose()
    assert is_db_outage(dropped) and dropped.connection_invalidated, dropped
    assert is_db_outage(refused) and not refused.connection_invalidated, refused
    assert "not currently accepting connections" in outage_reason(refused, pg_url)
    assert "SELECT" not in outage_reason(refused, pg_url)  # the driver's message only
    nowhere = make_engine("postgresql+psycopg2://flywheel:secret-pw@127.0.0.1:9/nowhere", connect_timeout_s=1)
    try:
        closed_port = _error(nowhere, "SELECT 1")
    finally:
        nowhere.dispose()
    assert is_db_outage(closed_port) and "secret-pw" not in outage_reason(closed_port, nowhere.url)

    # SQLite: never an outage, "database is locked" included.
    path = tmp_path / "locked.db"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    lite = make_engine(f"sqlite:///{path}", connect_timeout_s=0.1)
    try:
        locked = _error(lite, "SELECT 1")
    finally:
        lite.dispose()
        holder.close()
    assert "locked" in str(locked) and not is_db_outage(locked)
    assert not is_db_outage(ValueError("not a database error"))


def test_outage_wait_gives_up_after_its_timeout_or_when_stopped(pg_url: str, outage: Outage) -> None:
    engine = make_engine(pg_url)
    calls: list[float] = []
    try:
        outage.begin()
        error = _error(engine, "SELECT 1")
        wait = OutageWait(pg_url, 1.5)
        started = time.monotonic()
        with pytest.raises(DatabaseUnavailable) as caught:
            wait.wait(error, between=lambda: calls.append(time.monotonic()))
        assert 1.4 < time.monotonic() - started < 5
        assert caught.value.__cause__ is error and calls, calls
        with pytest.raises(DatabaseUnavailable):  # the same outage: no time left
            wait.wait(error)
        stopping = threading.Event()
        stopping.set()
        started = time.monotonic()
        assert OutageWait(pg_url, 30).wait(error, stop=stopping) is None  # asked to stop: gives up waiting
        assert time.monotonic() - started < 5
        outage.end()
        wait.turn_done()  # a good turn: the next error begins a new outage with the whole timeout
        assert wait.wait(error) < 1.0 and wait.count == 2
    finally:
        engine.dispose()
