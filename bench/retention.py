"""The retention job on a million raw events in PostgreSQL: rows/s, and ingest's p99 with and without it.

One Kafka-protocol broker and one PostgreSQL server, as :mod:`bench.ingest` starts them. Two runs of
its paced latency phase (:func:`bench.ingest.latency_phase`, the real ``flywheel ingest`` and
``flywheel rewards`` processes), each on a fresh database into which ``--rows`` raw events are
bulk-loaded after the warm-up (``COPY``, then ``VACUUM (ANALYZE)`` and ``CHECKPOINT``): 80 %
generations, 20 % feedback, sessions of ten events, ``--expired`` of them 60 days old (their
sessions closed then), the rest a day old:

1. ``baseline``: the paced workload alone, on the loaded database;
2. ``with_job``: the same, while :func:`flywheel.retention.run_once` (``[tenants."*"]
   retention_days = 30``, ``--batch`` rows per transaction, resting ``--rest`` times each batch's
   time after it, as the janitor does) deletes the expired rows beside it.

Reports the job's deletion rate (rows/s over its whole run; whether it outlasted the paced
phase) and the p99 event-to-scored latency of both runs and their ratio. Targets (issue 20):
``rows_per_s >= 10,000`` and ``p99 with the job <= 1.5 x`` the same-run baseline. Prints a table;
``--json PATH`` writes the figures.

    .venv/bin/python -m bench.retention --json /tmp/retention.json
    .venv/bin/python -m bench.retention --rows 20000 --rate 100 --seconds 5
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from bench.ingest import latency_phase, pg_admin
from bench.ingest_workload import workload
from flywheel.consent import TenantPolicy
from flywheel.retention import REST
from testbed.broker import kafka_broker

#: The policy the job enforces: every tenant's raw events for 30 days.
TENANTS = {"*": TenantPolicy(retention_days=30)}
#: Events per bench session (8 generations, 2 feedback) and rows per COPY chunk.
PER_SESSION = 10
CHUNK = 50_000
PAYLOAD = json.dumps({"bench": "x" * 300})


def _copy(cursor: Any, table: str, columns: str, lines: Iterator[str]) -> None:
    buffer = io.StringIO()
    count = 0
    for line in lines:
        buffer.write(line)
        count += 1
        if count % CHUNK == 0:
            buffer.seek(0)
            cursor.copy_expert(f"COPY {table} ({columns}) FROM STDIN", buffer)
            buffer = io.StringIO()
    buffer.seek(0)
    cursor.copy_expert(f"COPY {table} ({columns}) FROM STDIN", buffer)


def seed(url: str, rows: int, expired: float) -> dict[str, Any]:
    """Bulk-load ``rows`` raw events (module docstring); what was loaded and how fast."""
    from sqlalchemy import create_engine

    started = time.perf_counter()
    now = datetime.now(UTC)
    sessions = max(1, rows // PER_SESSION)
    n_old = int(sessions * expired)

    def at(s: int) -> str:
        return (now - timedelta(days=60 if s < n_old else 1)).isoformat()

    def generations() -> Iterator[str]:
        for s in range(sessions):
            for i in range(8):
                yield (f"bg-{s}-{i}\tbgen-{s}-{i}\tbench-{s % 4}\tbs-{s}\tline\t0\tbench\t{at(s)}\t{PAYLOAD}\t\\N\n")

    def feedback() -> Iterator[str]:
        for s in range(sessions):
            for i in range(2):
                yield (f"bf-{s}-{i}\tbfb-{s}-{i}\tbench-{s % 4}\tbs-{s}\tbgen-{s}-{i}\texplicit\tthumbs\t1\t"
                       f"{at(s)}\tjoined\t{{}}\n")

    def session_rows() -> Iterator[str]:
        for s in range(sessions):
            yield f"bench-{s % 4}\tbs-{s}\tclosed\t{at(s)}\t{at(s)}\t1\n"

    engine = create_engine(url)
    try:
        raw = engine.raw_connection()
        try:
            cursor = raw.cursor()
            _copy(cursor, "generations", "event_id, generation_id, tenant, session_id, model_line, model_version, "
                                         "node_id, ts, payload, user_hash", generations())
            _copy(cursor, "feedback", "event_id, feedback_id, tenant, session_id, generation_id, kind, signal, value, "
                                      "ts, state, payload", feedback())
            _copy(cursor, "sessions", "tenant, session_id, status, last_event_at, closed_at, revision", session_rows())
            raw.commit()
            # The load's aftermath (autovacuum of a million new rows, the dirty pages) is settled
            # before the paced phase, so neither run pays for it.
            raw.driver_connection.autocommit = True
            cursor.execute("VACUUM (ANALYZE) generations, feedback, sessions")
            cursor.execute("CHECKPOINT")
        finally:
            raw.close()
    finally:
        engine.dispose()
    wall = time.perf_counter() - started
    loaded = sessions * PER_SESSION
    return {"raw_events": loaded, "expired_raw_events": n_old * PER_SESSION, "sessions": sessions,
            "seconds": wall, "rows_per_s": loaded / wall}


@contextmanager
def beside(url: str, out: dict[str, Any], rows: int, expired: float, batch: int | None,
           rest: float = 0.0) -> Iterator[None]:
    """``bench.ingest.latency_phase``'s ``around``: load the rows, then (with ``batch``) run the job
    beside the paced phase; its report and timing go into ``out``."""
    out["seed"] = seed(url, rows, expired)
    print(f"loaded {out['seed']['raw_events']} raw events in {out['seed']['seconds']:.1f} s", flush=True)
    if batch is None:
        yield
        return
    # Its own process, as the janitor is: a thread here would take the GIL from the observer that
    # timestamps the scored rows, and the latency measured would be the bench's own.
    parent, child = multiprocessing.get_context("spawn").Pipe()
    job = multiprocessing.get_context("spawn").Process(target=retain, args=(url, batch, rest, child), name="retention")
    started = time.perf_counter()
    job.start()
    try:
        yield
    finally:
        out["phase_end_s"] = time.perf_counter() - started
        answer = parent.recv() if parent.poll(3600) else {"error": "the retention job sent nothing"}
        job.join(60)
    if "error" in answer:
        raise RuntimeError(f"the retention job failed: {answer['error']}")
    out["job"] = answer


def retain(url: str, batch: int, rest: float, conn: Any) -> None:
    """The job's process (:func:`beside`): one run of :func:`flywheel.retention.run_once`; its
    report, or its error, goes back through ``conn``."""
    from flywheel.db.session import make_engine, make_session_factory
    from flywheel.retention import run_once

    engine = make_engine(url)
    try:
        conn.send(run_once(TENANTS, make_session_factory(engine), batch=batch, rest=rest).as_json())
    except BaseException as exc:
        conn.send({"error": repr(exc)})
        raise
    finally:
        engine.dispose()


def run(args: argparse.Namespace) -> dict[str, Any]:
    paced = workload(int(args.rate * args.seconds), args.concurrency, args.seed)
    env = dict(item.split("=", 1) for item in args.env)
    n_ingest, n_rewards = (int(x) for x in args.level.split(":"))
    admin = pg_admin(args.pg_admin)
    result: dict[str, Any] = {"rows": args.rows, "expired": args.expired, "batch": args.batch, "rest": args.rest,
                              "rate": args.rate, "seconds": args.seconds, "level": args.level}
    try:
        with kafka_broker(args.bootstrap or os.environ.get("KAFKA_BOOTSTRAP_SERVERS")) as (bootstrap, _):
            for name, batch in (("baseline", None), ("with_job", args.batch)):
                side: dict[str, Any] = {}
                lat = latency_phase(bootstrap, admin, {}, paced, args.partitions, n_ingest, n_rewards, args.rate,
                                    args.warmup, env, args.drain,
                                    around=lambda url, side=side, batch=batch: beside(url, side, args.rows,
                                                                                       args.expired, batch, args.rest))
                result[name] = {"latency": lat, **side}
                print(f"{name}: p99 event-to-scored {lat['p99_event_to_scored_s']:.3f} s"
                      + (f"; job {side['job']['rows_per_s']:.0f} rows/s" if "job" in side else ""), flush=True)
    finally:
        admin.dispose()
    base, with_job = result["baseline"]["latency"], result["with_job"]["latency"]
    job = result["with_job"]["job"]
    result["rows_per_s"] = job["rows_per_s"]
    result["deleted"] = job["rows"]
    result["p99_baseline_s"] = base["p99_event_to_scored_s"]
    result["p99_with_job_s"] = with_job["p99_event_to_scored_s"]
    result["p99_ratio"] = result["p99_with_job_s"] / result["p99_baseline_s"]
    result["job_outlasted_phase"] = job["seconds"] >= result["with_job"]["phase_end_s"]
    result["targets"] = {
        "rows_per_s_ge_10000": result["rows_per_s"] >= 10_000,
        "p99_ratio_le_1_5": bool(result["p99_ratio"] <= 1.5 and not base["lower_bound"]
                                 and not with_job["lower_bound"]),
    }
    return result


def table(result: dict[str, Any]) -> str:
    base, job = result["baseline"]["latency"], result["with_job"]["latency"]
    lines = [f"{'run':<10} {'p50 s':>8} {'p99 s':>8} {'x base':>7} {'deleted':>9} {'rows/s':>9} {'job s':>7}",
             f"{'baseline':<10} {base['p50_event_to_scored_s']:>8.3f} {base['p99_event_to_scored_s']:>8.3f} "
             f"{1.0:>7.2f} {'':>9} {'':>9} {'':>7}",
             f"{'with_job':<10} {job['p50_event_to_scored_s']:>8.3f} {job['p99_event_to_scored_s']:>8.3f} "
             f"{result['p99_ratio']:>7.2f} {result['deleted']:>9} {result['rows_per_s']:>9.0f} "
             f"{result['with_job']['job']['seconds']:>7.1f}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="raw events loaded into each run's database")
    parser.add_argument("--expired", type=float, default=0.9, help="the share of them older than the retention")
    parser.add_argument("--batch", type=int, default=2_000, help="rows per transaction of the job")
    parser.add_argument("--rest", type=float, default=REST,
                        help="seconds the job rests per second of deleting (the janitor's retention.rest)")
    parser.add_argument("--rate", type=float, default=200.0, help="paced events/s of the ingest workload")
    parser.add_argument("--seconds", type=float, default=30.0, help="length of each paced phase")
    parser.add_argument("--warmup", type=float, default=2.0, help="outcomes sent in the first seconds do not count")
    parser.add_argument("--drain", type=float, default=60.0, help="how long to wait for the last outcomes")
    parser.add_argument("--level", default="1:1", help="ingest:rewards worker processes")
    parser.add_argument("--concurrency", type=int, default=50, help="sessions in flight at once")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--bootstrap", help="Kafka bootstrap servers (default KAFKA_BOOTSTRAP_SERVERS, else Tansu)")
    parser.add_argument("--pg-admin", help="SQLAlchemy URL of a PostgreSQL admin database (fresh ones are made)")
    parser.add_argument("--env", action="append", default=[], metavar="FLYWHEEL_X=V", help="settings for the workers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    result = run(args)
    print(table(result))
    print(f"retention {result['rows_per_s']:.0f} rows/s (target >= 10,000: {result['targets']['rows_per_s_ge_10000']}); "
          f"p99 event-to-scored {result['p99_with_job_s']:.3f} s with the job vs {result['p99_baseline_s']:.3f} s "
          f"without = {result['p99_ratio']:.2f} x (target <= 1.5: {result['targets']['p99_ratio_le_1_5']}); "
          f"the job {'outlasted' if result['job_outlasted_phase'] else 'ended within'} the paced phase")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    return result


if __name__ == "__main__":
    main()
