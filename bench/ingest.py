"""What ingest + rewards cost: raw Kafka consume rate vs the real pipeline, and event-to-scored latency.

One Kafka-protocol broker (``--bootstrap`` or ``KAFKA_BOOTSTRAP_SERVERS``, else a Tansu started
here) and one PostgreSQL server (a fresh, migrated database per phase, dropped afterwards), both
from :mod:`testbed`. The workload (:mod:`bench.ingest_workload`) is built by the gateway's own
capture code (:mod:`serving.gateway.capture`) from vLLM-shaped responses: sessions of 1-4 turns
(first prompt 64-160 tokens; each later prompt extends the previous one by its completion and a
16-token user message), 32 completion tokens with logprobs, a thumbs on a fifth of the turns, then
an outcome. ``--concurrency`` sessions are in flight at once; records are keyed by session id and carry the gateway's headers.

Phases, in one run, on the same broker:

1. ``raw``: the backlog (``--events``) goes to fresh generations + feedback topics, then a bare
   ``KafkaConsumer`` (every partition assigned, no group, no processing) reads those same records,
   records/s from the poll that returned the first record to the last record, the median of three
   reads: ``raw_rate`` of the generations topic (the issue's baseline), ``raw_both_rate`` of both.
2. ``pipeline``: for each ``--levels I:R``, fresh topics with the same backlog, and ``I``
   ``flywheel ingest`` + ``R`` ``flywheel rewards`` processes (the real CLI) turn it into raw-event
   rows, trajectories and scored rows. ``pipeline_rate`` (best complete level) = events/s from the
   first committed batch (the database is polled every 0.1 s) until every event is stored and
   every session has a scored row. Per part, CPU ms per 1000 events (workers by role, PostgreSQL,
   the broker when started here, the whole machine) and ``other_load_cores``, the machine's busy
   cores not explained by those parts: on a shared machine the rates move with it, CPU per event
   much less.
3. ``latency``: fresh topics and database, the best level's workers (``--latency-level``) warmed up by one session,
   then the workload sent at a paced ``--rate`` events/s for ``--seconds``. Each outcome's latency
   runs from just before its ``send`` to its session's first scored row being visible in the
   database (polled every 50 ms; held-out sessions are stored but never produced, so the row is
   the signal every session reaches), and to its trajectory on the trajectories topic (the ingest
   share). Outcomes still unscored after ``--drain`` s count at that time: ``lower_bound``.

``--profile DIR`` attaches ``py-spy record`` to the first level's workers and prints their top
frames (raw stacks stay in DIR; CPU and profiles: :mod:`bench.profiling`); ``--env`` and
``--db-setting`` try worker settings and PostgreSQL settings. Prints a table; ``--json PATH`` writes ``raw_rate``,
``pipeline_rate``,
``p99_event_to_scored_s`` and the rest. Targets (issue 4): ``pipeline_rate >= 0.5 x raw_rate``;
``p99_event_to_scored_s < 2`` at 1,000 events/s.

    .venv/bin/python -m bench.ingest --json /tmp/ingest.json
    .venv/bin/python -m bench.ingest --events 5000 --levels 1:1 --seconds 0 --profile /tmp/prof
    .venv/bin/python -m bench.ingest --levels 1:1 --rate 500 --env FLYWHEEL_BUS__COMPRESSION=zstd
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.ingest_workload import TENANT, Event, is_outcome, session, workload
from bench.profiling import CpuMeter, Profiler, backend_pids, profile_lines
from flywheel.events import GenerationEvent
from testbed.broker import kafka_broker
from testbed.postgres import connect_admin, fresh_database
from testbed.procs import ServiceUnavailable

ROOT = Path(__file__).resolve().parents[1]
#: Short group timeouts (as the test suite uses) so joins take seconds; the rest are product defaults.
KAFKA_ENV = {"FLYWHEEL_BUS__SESSION_TIMEOUT_MS": "6000", "FLYWHEEL_BUS__HEARTBEAT_INTERVAL_MS": "500"}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(round(q / 100.0 * (len(ordered) - 1))))]


# Services ---------------------------------------------------------------------------------------


def pg_admin(url: str | None):
    """An AUTOCOMMIT engine on the PostgreSQL admin database (``--pg-admin``, else postgres or $USER)."""
    try:
        return connect_admin(url)
    except ServiceUnavailable as exc:
        raise SystemExit(str(exc)) from None


@contextmanager
def migrated_database(admin, settings: dict[str, str]) -> Iterator[str]:
    """A new, migrated PostgreSQL database with ``settings`` (``ALTER DATABASE .. SET``); dropped afterwards."""
    from flywheel.db.session import upgrade

    with fresh_database(admin, "flywheel_bench_", settings) as url:
        upgrade(url)  # once here: workers starting together would race to create the tables
        yield url


# Bus --------------------------------------------------------------------------------------------


@dataclass
class Topics:
    bootstrap: str
    prefix: str
    partitions: int
    #: What the bench's producer compresses with (``bus.compression``; empty: flywheel's default).
    compression: str = ""

    def name(self, kind: str) -> str:
        return f"{self.prefix}{kind}"

    def settings(self):
        from flywheel.settings import load_settings

        bus = {"kind": "kafka", "bootstrap_servers": self.bootstrap, "topic_prefix": self.prefix,
               "partitions": self.partitions, "session_timeout_ms": 6000, "heartbeat_interval_ms": 500}
        return load_settings(data_dir=tempfile.gettempdir(),
                             bus=bus | ({"compression": self.compression} if self.compression else {}))


def fresh_topics(bootstrap: str, partitions: int, compression: str) -> Topics:
    from flywheel.bus import make_bus

    topics = Topics(bootstrap, f"bench{uuid.uuid4().hex[:8]}.", partitions, compression)
    bus = make_bus(topics.settings())
    try:
        bus.ensure_topics([topics.name(k) for k in ("generations", "feedback", "trajectories", "scored")])
    finally:
        bus.close()
    return topics


def produce(topics: Topics, events: list[Event]) -> int:
    """Send every event as the gateway's shipper does (key = session id, event headers); bytes sent."""
    from flywheel.bus import make_bus

    bus = make_bus(topics.settings())
    producer = bus.producer()
    sent = 0
    try:
        for i, event in enumerate(events):
            value = event.model_copy(update={"ts": datetime_now()}).to_bytes()  # a fresh backlog
            sent += len(value)
            producer.send(topics.name(event.topic), event.session_id, value,
                          {"event_type": type(event).__name__, "event_id": event.event_id})
            if i % 2000 == 1999:
                producer.flush()
        producer.flush()
    finally:
        producer.close()
        bus.close()
    return sent


def raw_consume(topics: Topics, kinds: list[str], expected: int, timeout_s: float = 120.0) -> dict[str, Any]:
    """A bare KafkaConsumer (the workers' fetch settings; every partition assigned, so no group
    join) reading ``expected`` records of ``kinds`` from the start; records/s from the first
    record to the last."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=topics.bootstrap, group_id=None, enable_auto_commit=False)
    parts = [TopicPartition(topics.name(k), p) for k in kinds for p in range(topics.partitions)]
    consumer.assign(parts)
    consumer.seek_to_beginning(*parts)
    count = size = 0
    start = time.perf_counter()
    first = last = None
    cpu0 = time.process_time()
    try:
        while count < expected and time.perf_counter() - start < timeout_s:
            polled = time.perf_counter()
            for batch in consumer.poll(timeout_ms=500, max_records=500).values():
                if first is None:
                    first = polled
                count += len(batch)
                size += sum(len(m.value) for m in batch)
            last = time.perf_counter()
    finally:
        consumer.close(autocommit=False)
    if first is None or count < expected:
        raise RuntimeError(f"raw consumer read {count} of {expected} records")
    wall = max(1e-9, last - first)
    return {"records": count, "mb": size / 1e6, "first_record_s": first - start, "wall_s": wall,
            "rate": count / wall, "mb_per_s": size / 1e6 / wall, "cpu_s": time.process_time() - cpu0}


def _median_run(read: Callable[[], dict[str, Any]], n: int = 3) -> dict[str, Any]:
    runs = sorted((read() for _ in range(n)), key=lambda r: r["rate"])
    return {**runs[n // 2], "rates": [r["rate"] for r in runs]}


class Observer(threading.Thread):
    """When each watched session first shows up: its trajectory on the trajectories topic, and its
    scored row committed in the database (polled every 50 ms; held-out trajectories are scored and
    stored but never produced, so the row, not the scored topic, is what every session reaches)."""

    def __init__(self, topics: Topics, database_url: str) -> None:
        super().__init__(name="observer", daemon=True)
        from kafka import KafkaConsumer, TopicPartition
        from sqlalchemy import create_engine

        self.consumer = KafkaConsumer(bootstrap_servers=topics.bootstrap, group_id=None, enable_auto_commit=False,
                                      fetch_max_wait_ms=20)
        parts = [TopicPartition(topics.name("trajectories"), p) for p in range(topics.partitions)]
        self.consumer.assign(parts)
        self.consumer.seek_to_beginning(*parts)
        self.engine = create_engine(database_url)
        self.lock = threading.Lock()
        self.watch: dict[str, str] = {}  # trajectory id -> session id, not seen scored yet
        self.trajectory_at: dict[str, float] = {}
        self.scored_at: dict[str, float] = {}
        self.halt = threading.Event()

    def expect(self, session_id: str) -> None:
        from flywheel.events import trajectory_id_for

        with self.lock:
            self.watch[trajectory_id_for(TENANT, session_id)] = session_id

    def run(self) -> None:
        from sqlalchemy import text

        query = text("SELECT DISTINCT trajectory_id FROM scored_trajectories WHERE trajectory_id = ANY(:ids)")
        next_db = 0.0
        try:
            while not self.halt.is_set():
                for batch in self.consumer.poll(timeout_ms=20, max_records=2000).values():
                    now = time.perf_counter()
                    for message in batch:
                        self.trajectory_at.setdefault(message.key.decode(), now)
                if time.perf_counter() < next_db:
                    continue
                next_db = time.perf_counter() + 0.05
                with self.lock:
                    ids = list(self.watch)[:2000]
                if not ids:
                    continue
                with self.engine.connect() as conn:
                    found = conn.execute(query, {"ids": ids}).scalars().all()
                now = time.perf_counter()
                with self.lock:
                    for trajectory_id in found:
                        self.scored_at.setdefault(self.watch.pop(trajectory_id), now)
        finally:
            self.consumer.close(autocommit=False)
            self.engine.dispose()


@dataclass
class Workers:
    """``flywheel ingest`` and ``flywheel rewards`` processes on ``topics`` and ``database_url``."""

    topics: Topics
    database_url: str
    n_ingest: int
    n_rewards: int
    env: dict[str, str]
    data_dir: Path
    procs: dict[str, list[subprocess.Popen]] = field(default_factory=dict)

    def start(self) -> Workers:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
        env.update({
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "FLYWHEEL_DATA_DIR": str(self.data_dir), "FLYWHEEL_LOG_LEVEL": "WARNING",
            "FLYWHEEL_BUS__KIND": "kafka", "FLYWHEEL_BUS__BOOTSTRAP_SERVERS": self.topics.bootstrap,
            "FLYWHEEL_BUS__TOPIC_PREFIX": self.topics.prefix, "FLYWHEEL_BUS__PARTITIONS": str(self.topics.partitions),
            "FLYWHEEL_DB__URL": self.database_url, **KAFKA_ENV, **self.env,
        })
        for role, n in (("ingest", self.n_ingest), ("rewards", self.n_rewards)):
            self.procs[role] = [subprocess.Popen([sys.executable, "-m", "launch.cli", role], cwd=ROOT, env=env)
                                for _ in range(n)]
        return self

    def check_alive(self) -> None:
        for role, procs in self.procs.items():
            for proc in procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"a {role} worker exited with {proc.returncode}")

    def stop(self) -> dict[str, list[int | None]]:
        for procs in self.procs.values():
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
        codes: dict[str, list[int | None]] = {}
        for role, procs in self.procs.items():
            for proc in procs:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                codes.setdefault(role, []).append(proc.returncode)
        return codes


# Phases -----------------------------------------------------------------------------------------


def db_counts(engine) -> tuple[int, int, int, int]:
    """(raw events, trajectories, scored rows, sessions with a scored row)."""
    from sqlalchemy import text

    with engine.connect() as conn:
        row = conn.execute(text(
            "SELECT (SELECT count(*) FROM generations) + (SELECT count(*) FROM feedback),"
            " (SELECT count(*) FROM trajectories), (SELECT count(*) FROM scored_trajectories),"
            " (SELECT count(DISTINCT trajectory_id) FROM scored_trajectories)")).one()
    return int(row[0]), int(row[1]), int(row[2]), int(row[3])


def db_progress(engine) -> tuple[bool, int]:
    """(any raw event stored, scored rows): cheap enough to poll while the workers run."""
    from sqlalchemy import text

    with engine.connect() as conn:
        row = conn.execute(text("SELECT EXISTS (SELECT 1 FROM generations) OR EXISTS (SELECT 1 FROM feedback),"
                                " (SELECT count(*) FROM scored_trajectories)")).one()
    return bool(row[0]), int(row[1])


def pipeline_phase(bootstrap: str, broker_pid: int | None, admin, db_settings: dict[str, str], events: list[Event],
                   n_sessions: int, partitions: int, n_ingest: int, n_rewards: int, env: dict[str, str],
                   profile_dir: Path | None, timeout_s: float) -> dict[str, Any]:
    from sqlalchemy import create_engine, make_url, text

    topics = fresh_topics(bootstrap, partitions, env.get("FLYWHEEL_BUS__COMPRESSION", ""))
    produce(topics, events)
    with migrated_database(admin, db_settings) as url, tempfile.TemporaryDirectory(prefix="bench-ingest-") as tmp:
        engine = create_engine(url)
        workers = Workers(topics, url, n_ingest, n_rewards, env, Path(tmp)).start()
        meter: CpuMeter | None = None
        profiler: Profiler | None = None
        try:
            launched = time.perf_counter()
            first_at = first_count = None
            deadline = launched + timeout_s
            counts = (0, 0, 0, 0)
            while time.perf_counter() < deadline:
                workers.check_alive()
                started, scored = db_progress(engine)
                now = time.perf_counter()
                if first_at is None and started:
                    first_at, first_count = now, db_counts(engine)[0]
                    meter = CpuMeter(workers.procs, broker_pid, lambda: backend_pids(admin, make_url(url).database))
                    profiler = Profiler(profile_dir, workers.procs)
                if scored >= n_sessions:
                    counts = db_counts(engine)
                    if counts[0] >= len(events) and counts[3] >= n_sessions:
                        break
                time.sleep(0.1)
            done_at = time.perf_counter()
            cpu = meter.used() if meter else {}
            profile = profiler.stop() if profiler else {}
            with engine.connect() as conn:
                reasons = dict(conn.execute(text(
                    "SELECT closed_reason, count(*) FROM trajectories GROUP BY closed_reason")).all())
        finally:
            codes = workers.stop()
            engine.dispose()
    complete = counts[0] >= len(events) and counts[3] >= n_sessions
    if first_at is None or first_count is None:
        raise RuntimeError("the pipeline persisted nothing")
    # From the first commit on; a backlog mostly done in the first batch counts from the launch instead.
    with_startup = first_count > len(events) // 2
    wall = max(1e-9, done_at - (launched if with_startup else first_at))
    processed = len(events) - (0 if with_startup else first_count)
    return {
        "ingest_workers": n_ingest, "rewards_workers": n_rewards, "complete": complete,
        "events": len(events), "sessions": n_sessions, "startup_s": first_at - launched, "wall_s": wall,
        "rate": processed / wall, "rate_includes_startup": with_startup, "sessions_per_s": n_sessions / wall,
        "raw_rows": counts[0], "trajectories": counts[1], "scored_rows": counts[2], "scored_sessions": counts[3],
        "closed_reasons": reasons, "cpu_s": cpu, "other_load_cores": max(0.0, cpu.get("machine", 0.0) - sum(
            v for k, v in cpu.items() if k != "machine")) / wall,
        "cpu_ms_per_1k_events": {k: v / max(1, processed) * 1e6 for k, v in cpu.items()},
        "exit_codes": codes, "profile": profile,
    }


def latency_phase(bootstrap: str, admin, db_settings: dict[str, str], events: list[Event], partitions: int,
                  n_ingest: int, n_rewards: int, rate: float, warmup_s: float, env: dict[str, str],
                  drain_s: float, around: Callable[[str], AbstractContextManager[Any]] | None = None) -> dict[str, Any]:
    """The paced phase (module docstring); ``around(database_url)``, when given, is entered after the
    warm-up and left after the drain (bench/retention.py runs its job in it)."""
    from flywheel.bus import make_bus

    topics = fresh_topics(bootstrap, partitions, env.get("FLYWHEEL_BUS__COMPRESSION", ""))
    with migrated_database(admin, db_settings) as url, tempfile.TemporaryDirectory(prefix="bench-ingest-") as tmp:
        workers = Workers(topics, url, n_ingest, n_rewards, env, Path(tmp)).start()
        observer = Observer(topics, url)
        observer.start()
        bus = make_bus(topics.settings())
        producer = bus.producer()
        side: AbstractContextManager[Any] | None = None
        try:
            # Warm-up: one whole session, sent until scored, so every worker has joined its group.
            probe = session(random.Random(-1))
            observer.expect(probe[0].session_id)
            for event in probe:
                producer.send(topics.name(event.topic), event.session_id, event.to_bytes())
            producer.flush()
            deadline = time.perf_counter() + 90
            while probe[0].session_id not in observer.scored_at:
                workers.check_alive()
                if time.perf_counter() > deadline:
                    raise RuntimeError("the pipeline did not score the warm-up session in 90 s")
                time.sleep(0.05)
            if around is not None:
                entered = around(url)
                entered.__enter__()
                side = entered
            sent_at: dict[str, float] = {}
            start = time.perf_counter()
            lag_max = 0.0
            for i, event in enumerate(events):
                due = start + i / rate
                now = time.perf_counter()
                if due > now:
                    time.sleep(due - now)
                else:
                    lag_max = max(lag_max, now - due)
                fresh = event.model_copy(update={"ts": datetime_now()})
                t = time.perf_counter()
                producer.send(topics.name(event.topic), event.session_id, fresh.to_bytes(),
                              {"event_type": type(event).__name__, "event_id": event.event_id})
                if is_outcome(event) and t - start >= warmup_s:
                    sent_at[event.session_id] = t
                    observer.expect(event.session_id)
            produce_wall = time.perf_counter() - start
            producer.flush()
            deadline = time.perf_counter() + drain_s
            while time.perf_counter() < deadline and not all(s in observer.scored_at for s in sent_at):
                workers.check_alive()
                time.sleep(0.05)
            drained_at = time.perf_counter()
        finally:
            if side is not None:  # before the workers stop: what ran beside them is over first
                side.__exit__(None, None, None)
            producer.close()
            bus.close()
            observer.halt.set()
            observer.join(10)
            codes = workers.stop()
    # An outcome still unscored when the drain ended counts as scored then: the p99 is a lower bound.
    scored = [observer.scored_at.get(s, drained_at) - t for s, t in sent_at.items()]
    ingested = [observer.trajectory_at.get(s, drained_at) - t for s, t in sent_at.items()]
    n_scored = sum(1 for s in sent_at if s in observer.scored_at)
    return {
        "ingest_workers": n_ingest, "rewards_workers": n_rewards, "target_rate": rate,
        "achieved_rate": len(events) / produce_wall, "producer_lag_max_s": lag_max, "events": len(events),
        "outcomes_measured": len(sent_at), "outcomes_scored": n_scored, "lower_bound": n_scored < len(sent_at),
        "p50_event_to_scored_s": percentile(scored, 50), "p90_event_to_scored_s": percentile(scored, 90),
        "p99_event_to_scored_s": percentile(scored, 99), "max_event_to_scored_s": max(scored, default=float("nan")),
        "p50_event_to_trajectory_s": percentile(ingested, 50), "p99_event_to_trajectory_s": percentile(ingested, 99),
        "exit_codes": codes,
    }


def datetime_now():
    from datetime import UTC, datetime

    return datetime.now(UTC)


# The run ----------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    env = dict(item.split("=", 1) for item in args.env)
    db_settings = dict(item.split("=", 1) for item in args.db_setting)
    levels = [tuple(int(x) for x in level.split(":")) for level in args.levels]
    t = time.perf_counter()
    backlog = workload(args.events, args.concurrency, args.seed)
    n_sessions = sum(1 for e in backlog if is_outcome(e))
    paced = workload(int(args.rate * args.seconds), args.concurrency, args.seed + 1) if args.seconds > 0 else []
    print(f"workload: {len(backlog)} events in {n_sessions} sessions "
          f"({sum(isinstance(e, GenerationEvent) for e in backlog)} generations, "
          f"{sum(len(e.to_bytes()) for e in backlog) / len(backlog) / 1e3:.1f} kB/event) "
          f"built in {time.perf_counter() - t:.1f} s", flush=True)
    admin = pg_admin(args.pg_admin)
    result: dict[str, Any] = {"events": len(backlog), "sessions": n_sessions, "partitions": args.partitions}
    try:
        with kafka_broker(args.bootstrap or os.environ.get("KAFKA_BOOTSTRAP_SERVERS")) as (bootstrap, broker_pid):
            result["broker"] = "external" if broker_pid is None else "tansu"
            topics = fresh_topics(bootstrap, args.partitions, env.get("FLYWHEEL_BUS__COMPRESSION", ""))
            result["produced_mb"] = produce(topics, backlog) / 1e6
            n_gen = sum(isinstance(e, GenerationEvent) for e in backlog)
            # The median of three reads each: one read of the backlog lasts well under a second.
            raw = _median_run(lambda: raw_consume(topics, ["generations", "feedback"], len(backlog)))
            raw_gen = _median_run(lambda: raw_consume(topics, ["generations"], n_gen))
            result.update(raw_rate=raw_gen["rate"], raw_both_rate=raw["rate"], raw_generations=raw_gen, raw_both=raw)
            print(f"raw kafka-python consume: {raw_gen['rate']:.0f} records/s ({raw_gen['mb_per_s']:.1f} MB/s) of the "
                  f"generations topic, {raw['rate']:.0f} records/s over both topics", flush=True)
            print(HEADER, flush=True)
            rows = []
            for i, (n_ingest, n_rewards) in enumerate(levels):
                row = pipeline_phase(bootstrap, broker_pid, admin, db_settings, backlog, n_sessions, args.partitions,
                                     n_ingest, n_rewards, env, args.profile / f"{n_ingest}x{n_rewards}"
                                     if args.profile and i == 0 else None, args.timeout)
                row["ratio_to_raw"] = row["rate"] / raw_gen["rate"]
                rows.append(row)
                print(_row(row), flush=True)
            result["pipeline"] = rows
            best = max(rows, key=lambda r: r["rate"] if r["complete"] else 0.0)
            result["pipeline_rate"] = best["rate"] if best["complete"] else 0.0
            result["pipeline_level"] = f"{best['ingest_workers']}:{best['rewards_workers']}"
            result["pipeline_ratio"] = result["pipeline_rate"] / raw_gen["rate"]
            result["latency"] = lat = None
            if paced:
                n_ingest, n_rewards = (best["ingest_workers"], best["rewards_workers"]) if not args.latency_level \
                    else tuple(int(x) for x in args.latency_level.split(":"))
                lat = latency_phase(bootstrap, admin, db_settings, paced, args.partitions, n_ingest, n_rewards,
                                    args.rate, args.warmup, env, args.drain)
                result["latency"] = lat
                print(_latency_line(lat), flush=True)
            result["p99_event_to_scored_s"] = lat["p99_event_to_scored_s"] if lat else None
    finally:
        admin.dispose()
    result["targets"] = {
        "pipeline_ratio_ge_0_5": result["pipeline_ratio"] >= 0.5,
        "p99_lt_2s_at_1000": bool(lat and not lat["lower_bound"] and lat["p99_event_to_scored_s"] < 2.0
                                  and lat["achieved_rate"] >= 0.98 * 1000),
    }
    return result


def _latency_line(lat: dict[str, Any]) -> str:
    bound = ">= " if lat["lower_bound"] else ""
    return (f"latency at {lat['target_rate']:.0f} events/s (achieved {lat['achieved_rate']:.0f}, "
            f"{lat['ingest_workers']}:{lat['rewards_workers']}): outcome -> scored p50 "
            f"{lat['p50_event_to_scored_s']:.3f} s, p90 {lat['p90_event_to_scored_s']:.3f} s, p99 "
            f"{bound}{lat['p99_event_to_scored_s']:.3f} s, max {lat['max_event_to_scored_s']:.3f} s "
            f"({lat['outcomes_scored']}/{lat['outcomes_measured']} scored); outcome -> trajectory p50 "
            f"{lat['p50_event_to_trajectory_s']:.3f} s, p99 {lat['p99_event_to_trajectory_s']:.3f} s")


HEADER = (f"{'ingest:rewards':>14} {'events/s':>9} {'x raw':>6} {'sessions/s':>10} {'wall s':>7} "
          f"{'start s':>7}  cpu ms/1k events: {'ingest':>6} {'rewards':>7} {'postgres':>8} {'broker':>6} "
          f"{'machine':>7}  {'other cores':>11}  complete")


def _row(r: dict[str, Any]) -> str:
    c = r["cpu_ms_per_1k_events"]
    return (f"{r['ingest_workers']:>7}:{r['rewards_workers']:<6} {r['rate']:>9.0f} {r['ratio_to_raw']:>6.2f} "
            f"{r['sessions_per_s']:>10.0f} {r['wall_s']:>7.1f} {r['startup_s']:>7.1f}  {'':>17} "
            f"{c.get('ingest', 0):>6.0f} {c.get('rewards', 0):>7.0f} {c.get('postgres', 0):>8.0f} "
            f"{c.get('broker', float('nan')):>6.0f} {c.get('machine', 0):>7.0f}  {r['other_load_cores']:>11.2f}"
            f"  {r['complete']}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=20_000, help="backlog size for the raw and pipeline phases")
    parser.add_argument("--levels", nargs="+", default=["1:1", "2:1"], help="ingest:rewards worker processes")
    parser.add_argument("--rate", type=float, default=1000.0, help="paced events/s of the latency phase")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of the latency phase (0: skip it)")
    parser.add_argument("--warmup", type=float, default=2.0, help="outcomes sent in the first seconds do not count")
    parser.add_argument("--drain", type=float, default=60.0, help="how long to wait for the last outcomes")
    parser.add_argument("--latency-level",
                        help="ingest:rewards for the latency phase (default: the level with the best pipeline rate)")
    parser.add_argument("--concurrency", type=int, default=200, help="sessions in flight at once")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--bootstrap", help="Kafka bootstrap servers (default KAFKA_BOOTSTRAP_SERVERS, else Tansu)")
    parser.add_argument("--pg-admin", help="SQLAlchemy URL of a PostgreSQL admin database (fresh ones are made)")
    parser.add_argument("--timeout", type=float, default=600.0, help="per pipeline level")
    parser.add_argument("--env", action="append", default=[], metavar="FLYWHEEL_X=V",
                        help="settings for the workers (FLYWHEEL_BUS__COMPRESSION also for the bench's producer)")
    parser.add_argument("--db-setting", action="append", default=[], metavar="NAME=VALUE",
                        help="PostgreSQL setting of the fresh databases (e.g. synchronous_commit=off)")
    parser.add_argument("--profile", type=Path, help="py-spy stacks of the first level's workers go here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    result = run(args)
    for row in result["pipeline"]:
        if row["profile"]:
            print("\n".join(profile_lines(row["profile"], 12)))
    p99 = result["p99_event_to_scored_s"]
    print(f"pipeline {result['pipeline_rate']:.0f} events/s = {result['pipeline_ratio']:.2f} x raw "
          f"{result['raw_rate']:.0f} (target >= 0.5: {result['targets']['pipeline_ratio_ge_0_5']}); "
          f"p99 event-to-scored {'-' if p99 is None else f'{p99:.3f} s'} at {args.rate:.0f} events/s "
          f"(target < 2 s at 1000: {result['targets']['p99_lt_2s_at_1000']})")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    return result


if __name__ == "__main__":
    main()
