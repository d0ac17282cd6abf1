"""The invariants: pure checks over a :class:`Snapshot` of what clients saw, the database and nodes.

- ``captured``: every response a client received has exactly one generation row, naming the
  version the client was told; a row no client received belongs to a request whose connection
  broke (at most one per such request).
- ``feedback_joined``: every accepted feedback event has one row, joined to its session's newest
  trajectory or stored as expired.
- ``trajectories_unique``: one trajectory per session, revisions 0..k once each, the newest holding
  every generation of the session and no generation in two trajectories.
- ``scores_reproducible``: every revision scored once; re-assembled from the raw generation and
  feedback rows (``ingest.assemble``, the pure function ingest uses) it is identical to the stored
  one; ``flywheel rewards rescore`` under a copy of the live spec gives the same rewards.
- ``weights_verified``: every version a node loaded is registered, has the registry's sha256 and
  still rebuilds to it from the store; every generation names a version its node had loaded.
- ``rollout_safe``: every version a node served live had been promoted to stable; every generation
  names a version that had been made canary or stable before it was served (a canary serves its
  share of sessions without being a node's live version); at the end each node serves the stable
  version, or reports ``failed_update`` and serves an earlier stable one.
- ``trainer_exactly_once``: no version published twice from one checkpoint, no trajectory in the
  ``trajectory_ids`` of two versions, none trained that is unknown or held out, no fork.
- ``poison_dead_lettered``: every poison record a rogue producer wrote onto a consumed topic
  (``chaos.poison``) is on that topic's dead-letter topic with a reason, or is accounted for by its
  kind's documented rule (feedback naming ids that exist nowhere: stored, joined to nothing); no
  good record is dead-lettered. Trivially true where no poison was produced and nothing dead-lettered.
- ``recovered``: once the faults were healed, the system caught up within the settle timeout.
- ``fault_checks``: what each fault must cause (the scenario's :class:`Expectation` list).
- ``forgotten_leave_no_trace``: an erased subject's sessions left nothing stored, nothing produced
  after the erasure completed, nothing trained later (:mod:`chaos.forgotten`). The invariants above
  are checked without those sessions' client-side items (:func:`without_forgotten`): their rows are
  gone by design. Trivially true where nothing was erased.

``lost`` counts client-acknowledged items missing downstream (responses without a generation row,
accepted feedback neither joined nor expired, generations in no trajectory, revisions never
scored, good scored trajectories the trainer dead-lettered); ``duplicated`` counts rows or trainings
that exist more than once. :func:`lost_items` lists the lost items for :func:`chaos.diagnose.diagnose`.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from chaos.fleet import NODES
from chaos.forgotten import Forgotten, check_no_trace, sessions_of, trajectory_ids_of
from chaos.users import ClientLog
from flywheel.events import FeedbackEvent, GenerationEvent, TrajectoryEvent
from ingest.assemble import assemble  # pure: the replay of what ingest did


@dataclass
class Expectation:
    """What a fault must cause, as the fault found it (``fault_checks``)."""

    name: str
    ok: bool
    detail: str


@dataclass(frozen=True)
class GenRow:
    generation_id: str
    event_id: str
    session_id: str
    model_version: int
    node_id: str
    payload: dict[str, Any]
    ts: datetime | None = None  # when it was served (UTC)


@dataclass(frozen=True)
class FeedbackRow:
    feedback_id: str
    event_id: str
    session_id: str
    state: str
    payload: dict[str, Any]


@dataclass(frozen=True)
class TrajectoryRow:
    trajectory_id: str
    revision: int
    session_id: str
    tenant: str
    closed_reason: str
    payload: dict[str, Any]


@dataclass(frozen=True)
class ScoredRow:
    trajectory_id: str
    revision: int
    spec: str
    payload: dict[str, Any]


@dataclass(frozen=True)
class VersionRow:
    version: int
    kind: str
    parent: int | None
    sha256: str
    status: str
    trajectory_ids: tuple[str, ...]
    publish_token: str | None
    rebuild_error: str | None  # None: the store rebuilds it to its sha256 now (checked for served versions)
    created_at: datetime | None = None  # when it was published (UTC)


#: What a poison record must become: dead-lettered by the stage that reads its topic, or (only for
#: a valid event naming ids that exist nowhere, which no stage can tell from an early one) either
#: that or stored with nothing joined to it (see ``check_poison``).
DEAD_LETTER = "dead_letter"
#: The stage that reads each consumed topic (and dead-letters what it cannot decode or apply).
STAGES = {"generations": "ingest", "feedback": "ingest", "trajectories": "rewards", "scored": "trainer"}
STORED_UNJOINED = "dead_letter_or_stored_unjoined"


@dataclass(frozen=True)
class PoisonRecord:
    """One poison record the rogue producer wrote and the broker acknowledged (``chaos.poison``)."""

    id: str  # the value of its ``chaos.poison`` header, which its dead letter keeps
    topic: str  # the topic's short name: generations, feedback, trajectories, scored
    kind: str  # chaos.poison.KINDS
    rule: str  # DEAD_LETTER or STORED_UNJOINED
    event_id: str | None = None  # the event it claims to be, where it parses as one
    session_id: str | None = None


@dataclass(frozen=True)
class DeadLetter:
    """One record of a ``<topic>.dlq`` topic, from its ``dlq.*`` headers."""

    origin: str  # the short name of the topic it was read from (``dlq.origin_topic``)
    partition: int
    offset: int
    reason: str
    poison: str | None  # its ``chaos.poison`` header: None for a record no rogue wrote


@dataclass
class Snapshot:
    """Everything :func:`check` looks at: what the clients saw, the database, the nodes."""

    client: ClientLog
    generations: list[GenRow]
    feedback: list[FeedbackRow]
    session_status: dict[str, tuple[str, int]]
    trajectories: list[TrajectoryRow]
    scored: list[ScoredRow]
    live_spec: str
    rescore_spec: str
    versions: list[VersionRow]
    ever_stable: set[int]
    #: version -> when it first became canary or stable (UTC): from then on it may serve sessions.
    promoted_at: dict[int, datetime]
    node_loaded: dict[str, dict[int, set[str]]]  # node -> version -> sha256s (or 12-char prefixes) seen
    node_live: dict[str, set[int]]  # node -> versions it served as its live version
    node_final: dict[str, dict[str, Any]]  # node -> its /health at the end
    expectations: list[Expectation]
    settle: dict[str, Any] = field(default_factory=dict)  # :func:`settle`'s figures
    poison: list[PoisonRecord] = field(default_factory=list)  # what the rogue producer wrote
    dead_letters: list[DeadLetter] = field(default_factory=list)  # every dead-letter topic, read to the end
    #: poison id -> where it is on its own topic (``feedback[2]@153``), for those no dead letter names.
    poison_found: dict[str, list[str]] = field(default_factory=dict)
    #: Erasures, the sessions they tombstoned and what is left of them (``forgotten_leave_no_trace``).
    forgotten: Forgotten = field(default_factory=Forgotten)


@dataclass
class InvariantResult:
    name: str
    ok: bool
    detail: str
    lost: int = 0
    duplicated: int = 0


def _dups(counter: Counter[Any]) -> int:
    return sum(n - 1 for n in counter.values() if n > 1)


def _open_sessions(s: Snapshot) -> list[str]:
    """Sessions not closed, but for those only poison named that ended ``empty`` (feedback naming a
    session that does not exist: no generation ever arrives, ``poison_dead_lettered`` accounts)."""
    poisoned = {p.session_id for p in s.poison}
    return [sid for sid, (status, _) in s.session_status.items()
            if status != "closed" and not (status == "empty" and sid in poisoned)]


def _newest(s: Snapshot) -> dict[str, TrajectoryRow]:
    newest: dict[str, TrajectoryRow] = {}
    for t in s.trajectories:
        if t.session_id not in newest or t.revision > newest[t.session_id].revision:
            newest[t.session_id] = t
    return newest


def check_captured(s: Snapshot) -> InvariantResult:
    rows = Counter(g.generation_id for g in s.generations)
    by_id = {g.generation_id: g for g in s.generations}
    missing = [gid for gid in s.client.received if gid not in by_id]
    wrong = [gid for gid, r in s.client.received.items()
             if gid in by_id and (by_id[gid].model_version != r.version or by_id[gid].session_id != r.session_id)]
    broken = Counter(f.session_id for f in s.client.failures if f.kind == "connection")
    phantoms = Counter(g.session_id for g in by_id.values() if g.generation_id not in s.client.received)
    unexplained = {sid: n for sid, n in phantoms.items() if n > broken.get(sid, 0) or sid not in s.client.sessions}
    ok = not missing and not wrong and not unexplained and not _dups(rows)
    detail = (f"{len(s.client.received)} received: {len(missing)} without a row, {len(wrong)} naming another "
              f"version/session, {_dups(rows)} duplicate rows; {sum(phantoms.values())} rows no client received "
              f"({sum(unexplained.values())} not explained by a broken connection)")
    return InvariantResult("captured", ok, detail, lost=len(missing), duplicated=_dups(rows))


def check_feedback(s: Snapshot) -> InvariantResult:
    rows = Counter(f.feedback_id for f in s.feedback)
    by_id = {f.feedback_id: f for f in s.feedback}
    newest = _newest(s)
    missing = [fid for fid in s.client.feedback if fid not in by_id]
    states = Counter(by_id[fid].state for fid in s.client.feedback if fid in by_id)
    not_in_trajectory = []
    for fid, session_id in s.client.feedback.items():
        row = by_id.get(fid)
        if row is None or row.state != "joined":
            continue
        traj = newest.get(session_id)
        if traj is None or fid not in {f["feedback_id"] for f in traj.payload.get("feedback", [])}:
            not_in_trajectory.append(fid)
    pending = sum(n for state, n in states.items() if state not in ("joined", "expired"))
    lost = len(missing) + pending + len(not_in_trajectory)
    ok = lost == 0 and not _dups(rows)
    detail = (f"{len(s.client.feedback)} accepted: {dict(states)}; {len(missing)} without a row, "
              f"{len(not_in_trajectory)} joined but absent from the newest trajectory, {_dups(rows)} duplicate rows")
    return InvariantResult("feedback_joined", ok, detail, lost=lost, duplicated=_dups(rows))


def check_trajectories(s: Snapshot) -> InvariantResult:
    ids_per_session: dict[str, set[str]] = defaultdict(set)
    revisions: dict[str, Counter[int]] = defaultdict(Counter)
    for t in s.trajectories:
        ids_per_session[t.session_id].add(t.trajectory_id)
        revisions[t.session_id][t.revision] += 1
    extra_ids = sum(len(ids) - 1 for ids in ids_per_session.values())
    dup_revisions = sum(_dups(c) for c in revisions.values())
    gaps = [sid for sid, c in revisions.items() if sorted(c) != list(range(len(c)))]
    newest = _newest(s)
    owner: Counter[str] = Counter()
    incomplete = []
    by_session: dict[str, set[str]] = defaultdict(set)
    for g in s.generations:
        by_session[g.session_id].add(g.generation_id)
    for sid, traj in newest.items():
        ids = traj.payload.get("generation_ids", [])
        owner.update(set(ids))
        if len(ids) != len(set(ids)) or set(ids) != by_session.get(sid, set()):
            incomplete.append(sid)
    in_two = _dups(owner)
    untrajectoried = [gid for sid, gids in by_session.items() for gid in gids if sid not in newest]
    open_sessions = _open_sessions(s)
    state_mismatch = [sid for sid, traj in newest.items()
                      if s.session_status.get(sid, ("", -1))[1] != traj.revision]
    duplicated = extra_ids + dup_revisions + in_two
    ok = not duplicated and not gaps and not incomplete and not untrajectoried and not open_sessions and not state_mismatch
    detail = (f"{len(newest)} sessions, {len(s.trajectories)} revisions: {extra_ids} extra trajectory ids, "
              f"{dup_revisions} duplicate revisions, {len(gaps)} with gaps, {in_two} generations in two trajectories, "
              f"{len(incomplete)} newest revisions missing a generation, {len(untrajectoried)} generations in no "
              f"trajectory, {len(open_sessions)} sessions not closed, {len(state_mismatch)} session states out of step")
    return InvariantResult("trajectories_unique", ok, detail, lost=len(untrajectoried), duplicated=duplicated)


def rebuild_errors(s: Snapshot) -> list[str]:
    """Each stored revision re-assembled from the raw rows it names must be the stored one."""
    gens = {g.generation_id: g for g in s.generations}
    fbs = {f.event_id: f for f in s.feedback}
    errors = []
    for t in s.trajectories:
        stored = TrajectoryEvent.model_validate(t.payload)
        try:
            generations = [GenerationEvent.model_validate(gens[gid].payload) for gid in stored.generation_ids]
            feedback = [FeedbackEvent.model_validate(fbs[f.event_id].payload) for f in stored.feedback]
        except KeyError as exc:
            errors.append(f"{t.session_id} r{t.revision}: raw event {exc} missing")
            continue
        generations.sort(key=lambda g: (g.ts, g.generation_id))
        feedback.sort(key=lambda f: (f.ts, f.event_id))
        rebuilt = assemble(t.tenant, t.session_id, generations, feedback, closed_reason=stored.closed_reason,
                           revision=t.revision)
        if rebuilt.model_dump(mode="json") != stored.model_dump(mode="json"):
            errors.append(f"{t.session_id} r{t.revision}: differs from its re-assembly")
    return errors


def _rewards(payload: dict[str, Any]) -> tuple[Any, ...]:
    return (round(float(payload["total_reward"]), 9), tuple(round(float(x), 9) for x in payload["turn_rewards"]),
            tuple(sorted((k, round(float(v), 9)) for k, v in payload.get("reward_components", {}).items())),
            bool(payload.get("held_out")))


def check_scores(s: Snapshot) -> InvariantResult:
    keys = Counter((r.trajectory_id, r.revision, r.spec) for r in s.scored)
    live = {(r.trajectory_id, r.revision): r for r in s.scored if r.spec == s.live_spec}
    rescored = {(r.trajectory_id, r.revision): r for r in s.scored if r.spec == s.rescore_spec}
    unscored = [(t.trajectory_id, t.revision) for t in s.trajectories if (t.trajectory_id, t.revision) not in live]
    stray = [k for k in live if k not in {(t.trajectory_id, t.revision) for t in s.trajectories}]
    segments = [k for k, r in live.items() if k in {(t.trajectory_id, t.revision): 0 for t in s.trajectories}
                and r.payload.get("segments") != next(t.payload.get("segments") for t in s.trajectories
                                                      if (t.trajectory_id, t.revision) == k)]
    differ = [k for k, r in live.items() if k not in rescored or _rewards(r.payload) != _rewards(rescored[k].payload)]
    rebuilt = rebuild_errors(s)
    ok = not unscored and not stray and not segments and not differ and not rebuilt and not _dups(keys)
    detail = (f"{len(live)} scored under {s.live_spec}: {len(unscored)} revisions unscored, {len(stray)} scores of no "
              f"stored revision, {len(segments)} whose tokens differ from the trajectory, {len(rebuilt)} revisions "
              f"not rebuilt from raw events {rebuilt[:2]}, {len(differ)} not reproduced by `rewards rescore` "
              f"({s.rescore_spec})")
    return InvariantResult("scores_reproducible", ok, detail, lost=len(unscored), duplicated=_dups(keys))


def check_weights(s: Snapshot) -> InvariantResult:
    registered = {v.version: v for v in s.versions}
    bad = []
    for node, loaded in s.node_loaded.items():
        for version, shas in loaded.items():
            info = registered.get(version)
            if info is None:
                bad.append(f"{node} v{version}: not registered")
            elif any(sha and not info.sha256.startswith(sha) for sha in shas):
                bad.append(f"{node} v{version}: sha256 {sorted(shas)} is not the registry's {info.sha256[:12]}")
            elif info.rebuild_error is not None:
                bad.append(f"{node} v{version}: does not rebuild now: {info.rebuild_error}")
    unloaded = Counter((g.node_id, g.model_version) for g in s.generations
                       if g.model_version not in s.node_loaded.get(g.node_id, {}))
    ok = not bad and not unloaded
    served = sum(len(v) for v in s.node_loaded.values())
    detail = (f"{served} (node, version) loads, {len(bad)} unverified {bad[:3]}; {sum(unloaded.values())} generations "
              f"naming a version their node never loaded {dict(list(unloaded.items())[:3])}")
    return InvariantResult("weights_verified", ok, detail)


def check_rollout(s: Snapshot) -> InvariantResult:
    stable = max((v.version for v in s.versions if v.status == "stable"), default=None)
    never_stable = {node: sorted(v for v in live if v not in s.ever_stable) for node, live in s.node_live.items()}
    never_stable = {n: v for n, v in never_stable.items() if v}
    # A generation may name a canary (the node holds it beside its live version), but only one the
    # controller had made canary (or stable) before it was served.
    early: Counter[int] = Counter(g.model_version for g in s.generations
                                  if g.model_version not in s.promoted_at
                                  or (g.ts is not None and g.ts < s.promoted_at[g.model_version]))
    final_bad = {}
    for node, health in s.node_final.items():
        version, status = health.get("version"), health.get("update_status")
        if version == stable:
            continue
        if status == "failed_update" and version in s.ever_stable and (stable is None or version < stable):
            continue
        final_bad[node] = f"v{version} ({status}) while v{stable} is stable"
    missing = [n for n in NODES if n not in s.node_final]
    ok = not never_stable and not early and not final_bad and not missing
    canaried = sorted({g.model_version for g in s.generations} - s.ever_stable)
    detail = (f"stable v{stable}; nodes end on {({n: h.get('version') for n, h in s.node_final.items()})}; "
              f"live versions never promoted: {never_stable or 'none'}; generations of a version not yet canary or "
              f"stable: {dict(early) or 'none'} (served as canary only: {canaried or 'none'}); "
              f"off stable: {final_bad or 'none'}" + (f"; no final health from {missing}" if missing else ""))
    return InvariantResult("rollout_safe", ok, detail)


def check_trainer(s: Snapshot) -> InvariantResult:
    trained = [v for v in s.versions if v.publish_token is not None]
    tokens = Counter(v.publish_token for v in trained)
    ids = Counter(tid for v in trained for tid in v.trajectory_ids)
    parents = Counter(v.parent for v in trained)
    trainable = {r.trajectory_id for r in s.scored if r.spec == s.live_spec and not r.payload.get("held_out")}
    unknown = [tid for tid in ids if tid not in trainable]
    duplicated = _dups(ids) + _dups(tokens)
    ok = not duplicated and not unknown and not _dups(parents)
    detail = (f"{len(trained)} trained versions, {sum(ids.values())} trajectories trained: {_dups(ids)} trained twice, "
              f"{_dups(tokens)} checkpoints published twice, {_dups(parents)} forks, {len(unknown)} unknown or held out")
    return InvariantResult("trainer_exactly_once", ok, detail, duplicated=duplicated)


def check_poison(s: Snapshot) -> InvariantResult:
    """Every poison record is dead-lettered from its own topic with a reason, or, where its rule
    allows (``STORED_UNJOINED``), stored as feedback joined to no trajectory in a session that has
    none; no record without a ``chaos.poison`` header is dead-lettered. A good scored trajectory
    the trainer dead-lettered counts as lost here (no other invariant sees it); a good record of
    another topic dead-lettered is counted lost by ``captured``, ``feedback_joined`` or
    ``scores_reproducible``, and only flagged here."""
    if not s.poison and not s.dead_letters:
        return InvariantResult("poison_dead_lettered", True, "no poison produced, nothing dead-lettered")
    letters: dict[str, list[DeadLetter]] = defaultdict(list)
    good: dict[tuple[str, int, int], DeadLetter] = {}  # a record dead-lettered twice (redelivered) is one
    for d in s.dead_letters:
        if d.poison is None:
            good.setdefault((d.origin, d.partition, d.offset), d)
        else:
            letters[d.poison].append(d)
    feedback = {f.event_id: f for f in s.feedback}
    joined = {f.get("event_id") for t in s.trajectories for f in t.payload.get("feedback", [])}
    with_trajectory = {t.session_id for t in s.trajectories}
    outcomes: Counter[str] = Counter()
    unaccounted = []
    for p in s.poison:
        if any(d.origin == p.topic and d.reason.strip() for d in letters.get(p.id, [])):
            outcomes["dead-lettered"] += 1
            continue
        row = feedback.get(p.event_id or "")
        if (p.rule == STORED_UNJOINED and row is not None and row.state != "joined" and p.event_id not in joined
                and p.session_id not in with_trajectory):
            outcomes[f"stored as {row.state} feedback, in no trajectory"] += 1
            continue
        where = s.poison_found.get(p.id)
        unaccounted.append(f"{p.kind} on {p.topic}, not dead-lettered by {STAGES.get(p.topic, '?')} ({p.id}"
                           f"{', at ' + ' '.join(where) if where else ''}"
                           f"{', stored as ' + row.state + ' feedback' if row is not None else ''})")
    produced = {p.id for p in s.poison}
    unrecorded = sorted(pid for pid in letters if pid not in produced)
    good_scored = [key for key in good if key[0] == "scored"]
    ok = not unaccounted and not good
    per_topic = Counter(p.topic for p in s.poison)
    detail = (f"{len(s.poison)} poison records ({dict(per_topic)}): {dict(outcomes)}; {len(unaccounted)} unaccounted "
              f"{unaccounted[:8]}; {len(good)} good records dead-lettered "
              f"{[f'{d.origin}[{d.partition}]@{d.offset}: {d.reason[:100]}' for d in list(good.values())[:3]]}"
              + (f"; {len(unrecorded)} dead-lettered poison not recorded as produced (its flush failed)"
                 if unrecorded else ""))
    return InvariantResult("poison_dead_lettered", ok, detail, lost=len(good_scored))


def dead_letter_reasons(s: Snapshot) -> dict[str, Any]:
    """For the report: how many records each topic dead-lettered, and per poison (topic, kind) the
    reason its first dead letter gives (or what became of it)."""
    kinds = {p.id: f"{p.topic}/{p.kind}" for p in s.poison}
    reasons: dict[str, str] = {}
    for d in s.dead_letters:
        reasons.setdefault(kinds.get(d.poison or "", f"{d.origin}/good record"), d.reason[:160])
    for label in sorted(set(kinds.values()) - set(reasons)):
        reasons[label] = "not dead-lettered"
    return {"per_topic": dict(Counter(d.origin for d in s.dead_letters)), "reasons": dict(sorted(reasons.items()))}


def check_recovered(s: Snapshot) -> InvariantResult:
    """Liveness, next to the safety invariants: once the faults were healed, the system caught up
    (spool drained, everything received stored, sessions closed, trajectories scored) in time."""
    figures = {k: v for k, v in s.settle.items() if k not in ("settled", "settle_s")}
    if s.settle.get("settled"):
        return InvariantResult("recovered", True, f"caught up {s.settle.get('settle_s', 0):.0f}s after the faults healed")
    return InvariantResult("recovered", False, f"not caught up {s.settle.get('settle_s', 0):.0f}s after the faults "
                                               f"healed: {figures}")


def check_expectations(s: Snapshot) -> InvariantResult:
    failed = [e for e in s.expectations if not e.ok]
    detail = "; ".join(f"{'ok' if e.ok else 'FAILED'}: {e.name} ({e.detail})" for e in s.expectations) or "none"
    return InvariantResult("fault_checks", not failed, detail)


def check_forgotten(s: Snapshot) -> InvariantResult:
    ok, detail = check_no_trace(s.forgotten, s.generations, s.feedback, s.session_status, s.trajectories, s.scored,
                                s.versions)
    return InvariantResult("forgotten_leave_no_trace", ok, detail)


def without_forgotten(s: Snapshot) -> Snapshot:
    """``s`` without what clients sent in the tombstoned sessions (received, failed, accepted
    feedback) and without their trajectories in the versions' ``trajectory_ids``: an erasure deletes
    their rows, which the other invariants would count lost or unknown."""
    gone = sessions_of(s.forgotten)
    if not gone:
        return s
    c = s.client
    client = ClientLog(received={g: r for g, r in c.received.items() if r.session_id not in gone},
                       failures=[f for f in c.failures if f.session_id not in gone],
                       feedback={f: sid for f, sid in c.feedback.items() if sid not in gone},
                       feedback_refused=c.feedback_refused, sessions=c.sessions - gone)
    ids = trajectory_ids_of(s.forgotten)
    versions = [replace(v, trajectory_ids=tuple(t for t in v.trajectory_ids if t not in ids)) for v in s.versions]
    return replace(s, client=client, versions=versions)


CHECKS = (check_captured, check_feedback, check_trajectories, check_scores, check_weights, check_rollout,
          check_trainer, check_poison, check_recovered, check_expectations)


def check(s: Snapshot) -> list[InvariantResult]:
    """Every invariant over ``s`` (the module docstring says what each means): the :data:`CHECKS`
    without the tombstoned sessions, then ``forgotten_leave_no_trace`` over everything."""
    kept = without_forgotten(s)
    return [fn(kept) for fn in CHECKS] + [check_forgotten(s)]


def lost_items(s: Snapshot) -> dict[str, list[Any]]:
    """The client-acknowledged items missing downstream (what :func:`diagnose` looks for), but
    for the tombstoned sessions'."""
    s = without_forgotten(s)
    gens = {g.generation_id for g in s.generations}
    fbs = {f.feedback_id: f.state for f in s.feedback}
    live = {(r.trajectory_id, r.revision) for r in s.scored if r.spec == s.live_spec}
    return {
        "generations": sorted((r.session_id, gid) for gid, r in s.client.received.items() if gid not in gens),
        "feedback": sorted((sid, fid, fbs.get(fid)) for fid, sid in s.client.feedback.items()
                           if fbs.get(fid) not in ("joined", "expired")),
        "open_sessions": sorted(_open_sessions(s)),
        "unscored": sorted((t.session_id, t.trajectory_id, t.revision) for t in s.trajectories
                           if (t.trajectory_id, t.revision) not in live),
    }
