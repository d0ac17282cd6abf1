"""``flywheel rewards rescore --spec PATH`` and ``flywheel rewards report``: offline, database only.

Rescore rebuilds the scores of every stored trajectory (the ``trajectories`` table keeps each
revision's full TrajectoryEvent, itself rebuilt from the raw events) under another spec version,
into ``scored_trajectories``, without reading or writing the bus: nothing reaches the trainer
(produce a rescored set deliberately if you want it trained on). Trajectories are replayed in
storage order through a fresh normaliser, so advantages are reproducible; rows are inserted
idempotently and the spec version's stats are then rebuilt from its scored rows, so running it
twice gives the same rows. Rescoring under the version a live worker is using adds nothing the
worker has not (both insert-ignore the same keys). A trajectory of an erased subject's session
(flywheel/tombstones.py: one the erasure has not deleted yet) is skipped, and counted.

Report prints, per spec version, model line and served version, the training and held-out reward
rates (mean total reward) with counts, and the anomaly flag with its reason. Beside them, for the
versions it lists, what each version observed of the deployment's product metrics (built-in and
``[metrics.declared]``, booleans and floats) over all time, as the promotion gates observe them
(flywheel/db/observed.py): the sessions with a value and their mean. A metric is listed for a line
when some feedback in a session of the listed versions reports it (a metric nobody reports would be
a row of zeros, or nothing), then for each version with a session that counts, even at a mean of 0
(a boolean: every session served counts, reported or not).

``--json`` prints the list of reward rows it always printed, each row with one key added,
``metrics``: its (line, version)'s observations, ``{model_line, version, metric, type, level,
direction, sessions, mean}`` each. An added key keeps every reader of the list working (a new
top-level object would not); a version under two spec versions carries the same observations twice.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select

from flywheel.db.models import ScoredTrajectoryRow, Trajectory
from flywheel.db.observed import OBSERVABLE, Observed, observe, reported
from flywheel.db.session import make_session_factory, open_database
from flywheel.events import TrajectoryEvent
from flywheel.metrics import Metric, Metrics
from flywheel.settings import Settings
from flywheel.tombstones import Tombstones
from rewards import credit, store
from rewards.normalise import Normaliser
from rewards.scorer import Scorer
from rewards.spec import SpecError, load_spec

log = logging.getLogger("flywheel.rewards.rescore")

CHUNK = 500


@dataclass(frozen=True)
class RescoreResult:
    spec_version: str
    trajectories: int
    inserted: int
    held_out: int
    erased: int = 0


def rescore(settings: Settings, spec_path: str) -> RescoreResult:
    """Score every stored trajectory under the spec at ``spec_path`` (module docstring)."""
    spec = load_spec(spec_path, settings.product_metrics())
    engine = open_database(settings.database_url, settings.db.wait_s)
    sessions = make_session_factory(engine)
    scorer = Scorer(spec, transcripts=store.DbTranscripts(sessions), generations=store.DbGenerations(sessions),
                    judge_api_key=settings.rewards.judge_api_key)
    normaliser = Normaliser(spec.normalise)
    tombstones = Tombstones(sessions)
    seen = inserted = held = erased = 0
    try:
        with sessions() as db, db.begin():
            store.register_spec(db, spec)
        last_id = 0
        while True:
            with sessions() as db:
                rows = db.execute(select(Trajectory.id, Trajectory.payload).where(Trajectory.id > last_id)
                                  .order_by(Trajectory.id).limit(CHUNK)).all()
            if not rows:
                break
            last_id = rows[-1][0]
            batch = []
            tombstones.refresh()
            for _, payload in rows:
                traj = TrajectoryEvent.model_validate(payload)
                if tombstones.drops_session(traj.tenant, traj.session_id):
                    erased += 1
                    continue
                rewards = scorer(traj)
                held_out = scorer.held_out(traj)
                advantages = None if held_out else normaliser.advantages(
                    traj.tenant, traj.model_line, traj.prompt_key, rewards.turn_rewards, credit.turn_groups(traj))
                batch.append(scorer.scored(traj, rewards, advantages=advantages, held_out=held_out))
            with sessions() as db, db.begin():
                inserted += len(store.insert_scored(db, batch))
            seen += len(batch)
            held += sum(s.held_out for s in batch)
        with sessions() as db, db.begin():
            store.rebuild_stats(db, spec)
    finally:
        scorer.close()
        engine.dispose()
    log.info("rescored %d trajectories under %s: %d new rows, %d held out, %d of erased subjects skipped",
             seen, spec.version, inserted, held, erased)
    return RescoreResult(spec.version, seen, inserted, held, erased)


def report(settings: Settings, spec_version: str | None = None) -> list[dict[str, Any]]:
    """Per (spec version, model line, version): counts, rates, the flag and the version's product
    metrics (``metrics``, :func:`observed_metrics`), as plain dicts."""
    engine = open_database(settings.database_url, settings.db.wait_s)
    try:
        with make_session_factory(engine)() as db:
            rows = store.stats_rows(db, spec_version)
            scored = dict(db.execute(select(ScoredTrajectoryRow.reward_spec_version, func.count())
                                     .group_by(ScoredTrajectoryRow.reward_spec_version)).all())
            listed: dict[str, set[int]] = {}
            for r in rows:
                listed.setdefault(r.model_line, set()).add(r.model_version)
            observed = observed_metrics(db, settings.product_metrics(), {k: sorted(v) for k, v in listed.items()})
    finally:
        engine.dispose()
    per_version: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for o in observed:
        per_version.setdefault((o["model_line"], o["version"]), []).append(o)
    return [
        {
            "spec_version": r.reward_spec_version,
            "scored_rows": scored.get(r.reward_spec_version, 0),
            "model_line": r.model_line,
            "version": r.model_version,
            "train_count": r.train_count,
            "train_rate": r.train_sum / r.train_count if r.train_count else None,
            "held_out_count": r.held_out_count,
            "held_out_rate": r.held_out_sum / r.held_out_count if r.held_out_count else None,
            "flagged": r.flagged,
            "flag_reason": r.flag_reason,
            "metrics": per_version.get((r.model_line, r.model_version), []),
        }
        for r in rows
    ]


def observed_metrics(db: Any, metrics: Metrics, versions: Mapping[str, Sequence[int]]) -> list[dict[str, Any]]:
    """Each line's ``versions``' observations of each boolean and float metric of ``metrics`` over
    all time, by line, version, then metric: the metrics reported on the line's versions, for each
    version with a session that counts (module docstring). One query per line and metric reported."""
    out = []
    for line, numbers in sorted(versions.items()):
        names = reported(db, [m.name for m in metrics if m.declaration.type in OBSERVABLE], line, numbers)
        found = []
        for metric in metrics:
            if metric.declaration.type in OBSERVABLE and metric.name in names:
                found += [_observed_row(line, v, metric, o) for v, o in observe(db, metric, line, numbers).items() if o.n]
        out += sorted(found, key=lambda row: row["version"])  # stable: metrics keep their order
    return out


def _observed_row(line: str, version: int, metric: Metric, o: Observed) -> dict[str, Any]:
    d = metric.declaration
    return {"model_line": line, "version": version, "metric": metric.name, "type": d.type, "level": d.level,
            "direction": d.direction, "sessions": o.n, "mean": o.mean}


def format_report(rows: list[dict[str, Any]]) -> str:
    """The reward rows as a table, then the product metrics of their versions as another."""
    if not rows:
        return "no reward stats yet (nothing scored)"

    def rate(x: float | None) -> str:
        return "-" if x is None else f"{x:+.3f}"

    lines = [f"{'spec':<22} {'line':<16} {'version':>7} {'train n':>8} {'train':>7} {'held n':>7} {'held':>7}  flag"]
    for r in rows:
        lines.append(
            f"{r['spec_version']:<22} {r['model_line']:<16} {r['version']:>7} {r['train_count']:>8} "
            f"{rate(r['train_rate']):>7} {r['held_out_count']:>7} {rate(r['held_out_rate']):>7}  "
            + (f"FLAGGED: {r['flag_reason']}" if r["flagged"] else "")
        )
    return "\n".join(lines) + "\n\n" + format_metrics(rows)


def format_metrics(rows: list[dict[str, Any]]) -> str:
    """The product metrics the report's rows carry, once per (line, version, metric)."""
    unique: dict[tuple[str, int, str], dict[str, Any]] = {}
    for r in rows:
        for m in r["metrics"]:
            unique.setdefault((m["model_line"], m["version"], m["metric"]), m)
    if not unique:
        return "no product metrics observed on these versions (no feedback reports a metric)"
    lines = ["product metrics per version, all time (sessions with a value, their mean):",
             f"{'line':<16} {'version':>7} {'metric':<24} {'type':<7} {'level':<10} {'better':<6} {'sessions':>8} "
             f"{'mean':>9}"]
    for m in sorted(unique.values(), key=lambda m: (m["model_line"], m["version"])):
        lines.append(f"{m['model_line']:<16} {m['version']:>7} {m['metric']:<24} {m['type']:<7} {m['level']:<10} "
                     f"{m['direction'] or '-':<6} {m['sessions']:>8} {m['mean']:>9.4g}")
    return "\n".join(lines)


def main(args: argparse.Namespace, settings: Settings) -> int:
    """``flywheel rewards rescore --spec PATH`` / ``flywheel rewards report [--spec-version V] [--json]``."""
    if args.action == "rescore":
        if not args.spec:
            print("flywheel rewards rescore: --spec PATH is required", file=sys.stderr)
            return 2
        try:
            result = rescore(settings, args.spec)
        except SpecError as exc:
            print(f"flywheel: {exc}", file=sys.stderr)
            return 2
        print(f"rescored {result.trajectories} trajectories under {result.spec_version}: "
              f"{result.inserted} new rows, {result.held_out} held out")
        return 0
    rows = report(settings, args.spec_version)
    print(json.dumps(rows, indent=2) if args.json else format_report(rows))
    return 0
