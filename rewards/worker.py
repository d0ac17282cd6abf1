"""The rewards worker: trajectories from the bus -> scored (persisted, then produced).

Per polled batch: decode (undecodable -> dead letter), score every trajectory with the spec (pure
builders; the judge, when enabled, is called here, outside any transaction, and the text guards,
when enabled, read the trajectory's stored generations here too; a trajectory no builder
can score, or that ingest never stored (``rewards.require_stored``: a forged or stray record) -> dead
letter), then in ONE database
transaction: find the batch's rows already scored (a replay), compute advantages for the others
(``rewards.normalise``; held-out ones get none), insert them, move the per-version stats by what
was really inserted and re-evaluate the anomaly flags; commit. Then produce every non-held-out
scored trajectory that is for training, flush, and only then commit the offsets. A batch the
database refuses (or that cannot be made into scored rows) is stored again one trajectory per
transaction, the normaliser restored from the database first, and only what is still refused is
dead-lettered: one bad record never stops the stream, and never crash-loops the worker.

- A scored event's ``event_id`` is derived from ``(trajectory_id, revision, spec_version)`` and a
  replayed row is produced from its stored payload, so a crash anywhere replays the batch into the
  same rows (no-ops) and the same events, byte for byte (duplicates every consumer drops):
  at-least-once on the bus, exactly-once in the database.
- Held-out trajectories (``rewards.guards.is_held_out``) are scored and stored, never produced; so
  are those not for training (``data_use = "store_only"``, ``flywheel.consent``): they count in the
  version's statistics, the metrics and the gates like any other, and never reach the trainer.
- A trajectory of an erased subject's session (flywheel/tombstones.py) is dropped before anything
  else, counted ``erased``: neither scored, nor stored, nor dead-lettered (a dead letter would keep
  its content).
- The normalisation statistics are rebuilt from the database at start (``rewards.normalise``).
- A database outage (``flywheel.db.session.is_db_outage``) does not end the process: the batch that
  met it is abandoned, the normaliser dropped (it may have observed rewards that were never
  committed), and the worker waits for the database (up to ``db.wait_s`` per outage, beating its
  health file and polling the bus now and then to stay in its consumer group, dropping what that
  returns). Then it does what a restart does (spec registered, normaliser restored from the
  database), rewinds its partitions to their committed offsets and goes on, without leaving the
  group (no rebalance). A longer outage, and any other error, still ends the process.
- At start the spec is validated, checked against the deployment's product metrics (every metric a
  ``metrics`` builder reads is built in or declared, with the type, level and direction the
  settings give it: ``rewards.spec.check_metrics``), its custom builders resolved and its version
  registered: a spec that does not fit, or a changed spec under an old version, stops the worker
  before it scores anything.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence

from sqlalchemy.orm import Session, sessionmaker

from flywheel.bus import Consumer, Producer, Record, make_bus
from flywheel.bus.base import BAD_RECORD, route_to_dlq, stay_in_group
from flywheel.db.session import BAD_ROW, OutageWait, make_session_factory, open_database
from flywheel.events import ScoredTrajectory, TrajectoryEvent
from flywheel.health import Beat
from flywheel.settings import RewardSettings, Settings
from flywheel.tombstones import Tombstones
from rewards import credit, store
from rewards.builders import RewardOutput
from rewards.normalise import Normaliser
from rewards.scorer import Scorer, scored_event_id
from rewards.spec import RewardSpec, load_spec

log = logging.getLogger("flywheel.rewards")

POLL_TIMEOUT_S = 0.5
MAX_RECORDS = 200

__all__ = ["process", "run", "scored_event_id"]


def process(
    records: Sequence[Record],
    consumer: Consumer,
    sessions: sessionmaker[Session],
    producer: Producer,
    scorer: Scorer,
    normaliser: Normaliser,
    topic: str,
    counters: Counter[str],
    beat: Callable[[], object] | None = None,
    *,
    restore_rows: int = RewardSettings.model_fields["restore_rows"].default,
    require_stored: bool = RewardSettings.model_fields["require_stored"].default,
    tombstones: Tombstones | None = None,
) -> None:
    """Score, persist and produce one batch; the caller commits the offsets afterwards. ``beat``
    (the worker's heartbeat) is called after each trajectory is scored: a judge call may be slow.

    A record that cannot be decoded, scored or stored is dead-lettered and the batch goes on: a
    batch the database refuses is written again one trajectory per transaction (the normaliser
    restored from the database first, ``restore_rows`` rows, so nothing uncommitted counts) and
    only what it still refuses is dead-lettered."""
    decoded: list[tuple[Record, TrajectoryEvent]] = []
    for record in records:
        try:
            decoded.append((record, TrajectoryEvent.from_bytes(record.value)))
        except ValueError as exc:
            route_to_dlq(consumer, record, f"undecodable TrajectoryEvent: {exc}", counters, log)
    if tombstones is not None:
        tombstones.refresh()
        kept = [(r, t) for r, t in decoded if not tombstones.drops_session(t.tenant, t.session_id)]
        counters["erased"] += len(decoded) - len(kept)
        decoded = kept
    if require_stored and decoded:
        with sessions() as db:
            known = store.stored_trajectories(db, (traj.event_id for _, traj in decoded))
        missing = [(r, t) for r, t in decoded if t.event_id not in known]
        if missing and tombstones is not None:  # an erasure may have deleted it since the last read:
            tombstones.refresh(force=True)  # dropped, never dead-lettered (the letter would keep it)
            erased = {id(r) for r, t in missing if tombstones.drops_session(t.tenant, t.session_id)}
            counters["erased"] += len(erased)
            missing = [(r, t) for r, t in missing if id(r) not in erased]
            decoded = [(r, t) for r, t in decoded if id(r) not in erased]
        for record, traj in missing:
            route_to_dlq(consumer, record, f"unknown TrajectoryEvent: ingest stored no trajectory "
                         f"{traj.trajectory_id!r} revision {traj.revision} (event {traj.event_id}): not from ingest",
                         counters, log)
        decoded = [(r, t) for r, t in decoded if t.event_id in known]
    batch: dict[str, tuple[TrajectoryEvent, RewardOutput, Record]] = {}
    for record, traj in decoded:
        event_id = scored_event_id(traj.trajectory_id, traj.revision, scorer.spec.version)
        if event_id not in batch:  # a producer retry can put one trajectory twice in a batch
            try:
                rewards = scorer(traj)
            except BAD_RECORD as exc:  # a builder (or the judge's parser) cannot score this trajectory
                route_to_dlq(consumer, record, f"unscorable TrajectoryEvent: {type(exc).__name__}: {exc}",
                             counters, log)
                continue
            batch[event_id] = (traj, rewards, record)
            if beat is not None:
                beat()
    if not batch:
        return
    try:
        out = _store(batch, sessions, scorer, normaliser, counters)
    except BAD_ROW as exc:
        log.warning("a batch of %d trajectories could not be stored (%s: %s); storing them one by one",
                    len(batch), type(exc).__name__, str(exc)[:200])
        counters["batches_split"] += 1
        out = []
        _restore(sessions, scorer.spec, normaliser, restore_rows)
        for event_id, item in batch.items():
            try:
                out += _store({event_id: item}, sessions, scorer, normaliser, counters)
            except BAD_ROW as one:
                route_to_dlq(consumer, item[2], f"unstorable ScoredTrajectory: {type(one).__name__}: {one}",
                             counters, log)
                _restore(sessions, scorer.spec, normaliser, restore_rows)
    for s, text in out:  # re-produced even when not new: the previous attempt may have died before its flush
        if not s.held_out and s.data_use == "train":
            producer.send(topic, s.session_id, text.encode() if text is not None else s.to_bytes())
    producer.flush()


def _store(batch: dict[str, tuple[TrajectoryEvent, RewardOutput, Record]], sessions: sessionmaker[Session],
           scorer: Scorer, normaliser: Normaliser,
           counters: Counter[str]) -> list[tuple[ScoredTrajectory, str | None]]:
    """One transaction (module docstring); every scored trajectory of ``batch``, each with the JSON
    it was stored as when this call stored it (None: stored before, produced from its payload)."""
    spec = scorer.spec
    out: list[tuple[ScoredTrajectory, str | None]] = []
    with sessions() as db, db.begin():
        stored = store.stored_payloads(db, batch)
        fresh: list[ScoredTrajectory] = []
        for event_id, (traj, rewards, _) in batch.items():
            if event_id in stored:
                out.append((ScoredTrajectory.model_validate(stored[event_id]), None))
                continue
            held_out = scorer.held_out(traj)
            advantages = None if held_out else normaliser.advantages(
                traj.tenant, traj.model_line, traj.prompt_key, rewards.turn_rewards, credit.turn_groups(traj))
            fresh.append(scorer.scored(traj, rewards, advantages=advantages, held_out=held_out))
        encoded = {s.event_id: s.to_bytes().decode() for s in fresh}  # stored and produced from one encoding
        inserted = store.insert_scored(db, fresh, encoded)
        new = [s for s in fresh if s.event_id in inserted]
        store.apply_stats(db, spec, store.stats_deltas(db, spec.version, new))
        lost = [s.event_id for s in fresh if s.event_id not in inserted]  # another worker scored them first
        out += [(ScoredTrajectory.model_validate(p), None) for p in store.stored_payloads(db, lost).values()]
        out += [(s, encoded[s.event_id]) for s in new]
    counters["scored"] += len(new)
    counters["held_out"] += sum(s.held_out for s in new)
    counters["not_for_training"] += sum(s.data_use != "train" for s in new)
    counters["duplicates"] += len(batch) - len(new)
    return out


def _restore(sessions: sessionmaker[Session], spec: RewardSpec, normaliser: Normaliser, rows: int) -> None:
    """Put ``normaliser`` back to what the database holds (it may have observed uncommitted rewards)."""
    normaliser.reset()
    with sessions() as db, db.begin():
        store.restore_normaliser(db, normaliser, spec.version, rows)


def _prepare(sessions: sessionmaker[Session], spec: RewardSpec, restore_rows: int) -> tuple[Normaliser, int]:
    """What the worker does before it scores, at start and after an outage: register ``spec`` (or
    stop on a changed spec under an old version) and restore the normaliser from the newest
    ``restore_rows`` scored rows; returns it and how many rows it replayed."""
    normaliser = Normaliser(spec.normalise)
    with sessions() as db, db.begin():
        store.register_spec(db, spec)
        restored = store.restore_normaliser(db, normaliser, spec.version, restore_rows)
    return normaliser, restored


def run(settings: Settings, stop: threading.Event | None = None) -> None:
    """Score trajectories until ``stop`` is set (see the module docstring)."""
    stop = stop or threading.Event()
    spec = load_spec(settings.rewards.spec_path, settings.product_metrics())
    engine = open_database(settings.database_url, settings.db.wait_s)
    sessions = make_session_factory(engine)
    scorer = Scorer(spec, transcripts=store.DbTranscripts(sessions), generations=store.DbGenerations(sessions),
                    judge_api_key=settings.rewards.judge_api_key)
    normaliser: Normaliser | None
    normaliser, restored = _prepare(sessions, spec, settings.rewards.restore_rows)
    bus = make_bus(settings)
    sources, topic = settings.stage_topics("rewards"), settings.topic("scored")
    bus.ensure_topics([*sources, topic])
    consumer = bus.consumer(settings.group("rewards"), sources)
    producer = bus.producer()
    counters: Counter[str] = Counter()
    tombstones = Tombstones(sessions)
    # `flywheel health rewards`: beats every turn and every scored trajectory
    heartbeat = Beat(settings, "rewards", counters=counters)
    outages = OutageWait(settings.database_url, settings.db.wait_s)
    log.info("rewards scoring %s with spec %s (%s; normalisation restored from %d rows)",
             ", ".join(sources), spec.version, spec.sha256[:12], restored)
    try:
        while not stop.is_set():
            heartbeat.beat()
            try:
                if normaliser is None:  # after an outage: start over as a restart would, still in the group
                    normaliser, restored = _prepare(sessions, spec, settings.rewards.restore_rows)
                    consumer.rewind()
                    log.info("rewards: normalisation restored from %d rows", restored)
                records = consumer.poll(timeout_s=POLL_TIMEOUT_S, max_records=MAX_RECORDS)
                if records:
                    process(records, consumer, sessions, producer, scorer, normaliser, topic, counters, heartbeat.beat,
                            restore_rows=settings.rewards.restore_rows, require_stored=settings.rewards.require_stored,
                            tombstones=tombstones)
                    consumer.commit(records)
            except Exception as exc:
                outages.ride_out("rewards", exc, lambda: (heartbeat.beat(), stay_in_group(consumer)), stop)
                normaliser = None  # it may hold rewards never committed: restored from the database instead
                counters["db_outages"] += 1
                continue
            outages.turn_done()
    finally:
        log.info("rewards stopping: %s", dict(counters))
        heartbeat.close()
        consumer.close()
        producer.close()
        bus.close()
        scorer.close()
        engine.dispose()
