"""The rollout controller: on a schedule, gate candidates, run canaries, promote or roll back.

Every ``rollout.interval_s`` :func:`step` reads the registry and does at most one of:

1. **No canary running**: the newest ``candidate`` newer than stable that passes its gates
   (:func:`choose_candidate`) becomes ``canary`` (the gateway sends it ``canary_fraction`` of new
   sessions, sticky per session), or ``stable`` directly when ``canary_fraction`` is 0 or nothing
   is stable yet. The gates:

   - *held-out reward* (:func:`held_out_gate`, from ``reward_version_stats``): under the newest
     reward spec version in which both the candidate and stable have ``held_out_min_samples``
     held-out trajectories, the candidate's held-out reward rate (mean total reward) may not be
     below stable's by more than ``held_out_tolerance``; a version the reward guard flagged
     (training reward up, held-out not) fails. Without enough held-out samples (normal for a
     candidate that has served no traffic yet) the gate passes and says so in its reason.
   - *numerical parity* (:func:`parity_gate`): the version metric ``parity_metric`` (the trainer
     records ``parity``, the mean absolute difference between its logprobs and the served ones on
     on-policy tokens, in nats) must be below ``parity_max``; a version without it passes.

2. **A canary is running**: its generations since it became canary (its newest ``canary``
   transition) are compared with stable's over the same window (:func:`judge_canary`):

   - negative-feedback rate: generations with at least one negative feedback event naming them
     (thumbs with value < 0, ``edit_rejected``, ``retry``, ``abandon``; session-level feedback and
     ratings are not counted) over generations served;
   - error rate: generations whose ``finish_reason`` is ``"error"``. Requests the gateway failed
     (502/504 from the upstream) produce no generation event, so they are **not** counted: this
     rate only sees errors an engine reports inside a completed response;
   - latency: ``latency_ms`` of the generation events (the newest ``LATENCY_SAMPLE_CAP`` each).

   The rates use a one-sided two-proportion z-test (pooled variance, normal approximation,
   :func:`two_proportion_test`); latency a one-sided Mann-Whitney U test (normal approximation
   with tie and continuity corrections, :func:`mann_whitney_greater`) of the canary's latencies
   against stable's multiplied by ``1 + latency_tolerance``: a canary up to that much slower is
   not "worse". Each test is worse at ``p < alpha`` (no multiple-comparison correction: three
   tests at 0.05 roll back an equal canary about 14% of the time at each look).

   A canary that served nothing while stable served ``min_samples`` for ``window_s`` (no session
   reached it) is ``rolled_back``: waiting would stall the line.

   **On evidence.** When the line has gates (``rollout.must_win`` / ``rollout.must_not_lose`` on
   product metrics, flywheel/promotion.py), they decide instead of the three tests above
   (serving/rollout_metrics.py gathers each arm's sessions; serving/rollout_evidence.py's
   always-valid sequential tests stay valid however often the controller looks, which the
   fixed-sample tests do not): a gate lost rolls back at once; every must_win gate won (and every
   gate with ``min_samples`` sessions on each arm) promotes once ``window_s`` has passed; no win by
   ``max_window_s`` rolls back with "no evidence of a win". The three tests' figures are still
   computed and shown; a canary that served nothing is still rolled back as above. The gates'
   verdicts ride in the decision's figures (``evidence``), which the rollout role records each
   tick, and each look continues from the last one's.

3. **In either case, the fleet first**: a canary or stable version that no node can load (every node with
   a fresh database heartbeat reports ``failed_update`` for it, none serves it: :func:`unloadable`)
   is ``rolled_back`` at once; for stable, the version every fresh node still serves is restored
   first (:func:`~serving.rollout_policy.restore_after_failed_load`; without one, the previous
   stable version, as :func:`~serving.rollout_actions.manual_rollback` does). The nodes never left
   the version they served, so this puts the registry back in line with the fleet, and new
   sessions stop being sent to a version nobody has.
   Until both versions served ``min_samples`` generations: wait. Then any test worse (or the
   held-out gate failing now that the canary served traffic): ``rolled_back`` at once (the
   repeated looks make false rollbacks likelier, never false promotions). Otherwise, once
   ``window_s`` has passed: ``stable`` (the registry retires the old stable).

4. **A failed load implicates its chain.** When the controller rolls a version back because nodes
   failed to load it (step 3; or a canary that served nothing for ``window_s`` while some fresh
   node reports ``failed_update`` for it), the versions on its chain since the last version known
   good (:func:`~serving.rollout_policy.implicated`: newer than stable, or than the version the
   fleet serves and a rollback of stable restores; ``candidate``, or ``retired`` when it was stable
   on paper only) are moved to ``rolled_back`` in the same tick, before the version itself (so a
   crash in between leaves the version to roll back at the next tick, never one of them eligible),
   each audited with a reason naming the failed load. Any of them may be the damaged object, and which one is newest
   when the controller next looks is a matter of timing: so none of them is eligible again until an
   operator clears it (``flywheel rollout clear V``, :func:`~serving.rollout_actions.manual_clear`:
   rebuilt from its anchor with every hash on the chain checked, then back to ``candidate``,
   audited with who cleared it). Versions published later are not implicated: a delta chained on a
   repaired object loads, and one chained on a still-damaged object fails and is rolled back in turn.

5. **Promotions keep the release calendar** (serving/rollout_calendar.py; ``rollout.timezone``,
   ``windows``, ``freezes``, ``max_promotions_per_day``, ``min_soak_s``). A promotion that would
   replace a stable version (a canary that won, or a direct promote when ``canary_fraction`` is 0)
   is applied only while the calendar allows it; otherwise the decision is ``wait``, its reason says
   why and when the next opportunity is (``ready canary v7 waits: outside the release windows
   (mon-fri 09:00-17:00 Europe/Berlin); next window opens 2026-11-30 09:00 CET``) and its figures
   carry the calendar's (``{"calendar": {...}}``). The soak runs from the canary's start, or from a
   direct candidate's publication. The daily limit counts the controller's own promotions
   (:func:`automatic_promotions`): operators' promotions and pins are deliberate acts outside the
   calendar, and a rollback's restore is no promotion. Canary starts are not held (a canary only
   gathers evidence, and a window that opens on a canary already judged saves its whole
   ``window_s``), rollbacks never are (undoing harm does not wait for a window), and neither is a
   promotion when nothing is stable yet (the calendar protects a serving version; there is none).

Every decision is logged with its figures, every status change carries them (short) as the
registry's audited reason and is announced as a :class:`~flywheel.events.VersionEvent` on the
``versions`` topic. The operator's actions (``flywheel rollout promote|rollback|pin|unpin|clear``, the
gateway's admin routes) are serving/rollout_actions.py; the command is serving/rollout_cli.py.

**Pinned lines.** ``flywheel rollout pin V`` (:func:`~serving.rollout_actions.manual_pin`, :meth:`Registry.pin`) makes V
stable unless it is (any version whose weights rebuild to its hash, except a collected one), ends a
running canary by returning it to ``candidate`` (a pin is no verdict on it: after the unpin it may
be canaried again), so every new session goes to V (tenant pins, an explicit per-tenant admin
override, still apply; sessions already on the old canary stay sticky while a node holds it), and
freezes the line: while pinned each tick decides ``pinned`` (logged, no status change) and the
registry refuses status changes. Manual ``promote``/``rollback`` are refused with the pin's
who/when/why unless ``--force`` (``"force": true`` in the admin API): a forced promote of W moves the
pin to W; a forced rollback of the pinned version moves the pin to the version it restores. The line
stays frozen either way; only ``flywheel rollout unpin`` resumes automatic rollout. The pin lives in
the registry's database (durable, audited, written under the same line lock as the
compare-and-set), never in a process.

Invariants: the statistics and the decisions are pure functions of plain numbers
(``serving.rollout_policy``); the IO around them is reads of the registry and the database and
:meth:`Registry.set_status`; the registry is the only state; at most one decision per tick, one
status change except for a rollback (of stable: the restored version first, so a stable version
always exists; after a failed load: the implicated candidates first); a decision is applied only while the
version still has the status it was decided on (``Registry.set_status(..., expect=)``, a
compare-and-set under the line's lock).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from flywheel.events import VersionEvent
from flywheel.health import Beat
from flywheel.metrics import Metrics
from flywheel.settings import RolloutSettings, Settings
from flywheel.weights.registry import PinInfo, StatusChanged
from serving.rollout_actions import RolloutError, node_waker, pin_figures, version_event
from serving.rollout_calendar import Calendar, check
from serving.rollout_evidence import EvidenceDecision
from serving.rollout_metrics import evidence_figures, look, promotion_policy
from serving.rollout_policy import (
    IMPLICABLE,
    LATENCY_SAMPLE_CAP,
    NEGATIVE_SIGNALS,
    GateResult,
    HeldOutRow,
    VersionSample,
    choose_candidate,
    held_out_gate,
    implicated,
    judge_canary,
    parity_gate,
    restore_after_failed_load,
)
from serving.rollout_record import record

log = logging.getLogger(__name__)

#: The controller beats at least this often while it waits for its next decision.
BEAT_EVERY_S = 5.0
#: A node whose database heartbeat (every 10 s, and at every status change) is older than this is
#: gone and has no say in :func:`unloadable`.
NODE_FRESH_S = 60.0

# --- IO --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    action: str  # none | wait | canary | promote | rollback | pinned
    version: int | None
    reason: str
    figures: dict[str, Any] = field(default_factory=dict)
    #: The status ``version`` had when this was decided (applied only if it still has it).
    was: str | None = None

    @property
    def changed(self) -> bool:
        return self.action in ("canary", "promote", "rollback")


def held_out_rows(db: Any, model_line: str, versions: Sequence[int]) -> list[HeldOutRow]:
    """The ``reward_version_stats`` rows of ``versions``, newest reward spec version first."""
    from sqlalchemy import select

    from flywheel.db.models import RewardSpecRow
    from flywheel.db.models import RewardVersionStats as T

    query = (select(T.reward_spec_version, T.model_version, T.held_out_count, T.held_out_sum, T.flagged, T.flag_reason)
             .outerjoin(RewardSpecRow, RewardSpecRow.version == T.reward_spec_version)
             .where(T.model_line == model_line, T.model_version.in_(list(versions)))
             .order_by(RewardSpecRow.created_at.desc().nulls_last(), T.reward_spec_version.desc()))
    return [HeldOutRow(s, v, int(n), float(total), bool(f), r or "") for s, v, n, total, f, r in db.execute(query)]


def version_sample(db: Any, model_line: str, version: int, since: datetime) -> VersionSample:
    """What ``version`` served since ``since`` (module docstring, step 2)."""
    from sqlalchemy import and_, distinct, func, or_, select

    from flywheel.db.models import Feedback
    from flywheel.db.models import Generation as G

    served = and_(G.model_line == model_line, G.model_version == version, G.ts >= since)
    n = db.scalar(select(func.count()).select_from(G).where(served)) or 0
    errors = db.scalar(select(func.count()).select_from(G)
                       .where(served, G.payload["finish_reason"].as_string() == "error")) or 0
    negative_feedback = or_(and_(Feedback.signal == "thumbs", Feedback.value < 0),
                            Feedback.signal.in_(NEGATIVE_SIGNALS))
    negative = db.scalar(
        select(func.count(distinct(G.generation_id))).select_from(G)
        .join(Feedback, and_(Feedback.generation_id == G.generation_id, Feedback.tenant == G.tenant))
        .where(served, negative_feedback)) or 0
    latencies = db.scalars(select(G.payload["latency_ms"].as_float()).where(served)
                           .order_by(G.ts.desc()).limit(LATENCY_SAMPLE_CAP)).all()
    return VersionSample(int(n), int(negative), int(errors), tuple(float(v) for v in latencies if v is not None))


def failed_loads(db: Any, model_line: str, version: int, now: datetime) -> tuple[int, dict[str, str]]:
    """How many nodes of the line have a database heartbeat younger than :data:`NODE_FRESH_S`, and
    why each of those that failed to load ``version`` did: ``failed_update`` with a detail that names
    the version (as ``serving.node`` writes it) and not serving it. ``{node_id: why}``, sorted."""
    from sqlalchemy import select

    from flywheel.db.models import Node

    nodes = [n for n in db.scalars(select(Node).where(Node.model_line == model_line))
             if (now - n.last_heartbeat).total_seconds() <= NODE_FRESH_S]
    prefix = f"version {version}:"
    failed = {n.node_id: n.detail[len(prefix):].strip()[:200] for n in sorted(nodes, key=lambda n: n.node_id)
              if n.status == "failed_update" and n.detail.startswith(prefix) and n.live_version != version}
    return len(nodes), failed


def fleet_version(db: Any, model_line: str, now: datetime) -> int | None:
    """The version every node of the line with a fresh database heartbeat serves live, or None
    when they differ or none reports one."""
    from sqlalchemy import select

    from flywheel.db.models import Node

    live = {n.live_version for n in db.scalars(select(Node).where(Node.model_line == model_line))
            if (now - n.last_heartbeat).total_seconds() <= NODE_FRESH_S}
    return next(iter(live)) if len(live) == 1 else None


def unloadable(db: Any, model_line: str, version: int, now: datetime) -> str | None:
    """Why no node can serve ``version``: every fresh node of the line failed to load it
    (:func:`failed_loads`). None while some node serves it, is still loading it or failed on
    something else, or no node reports at all."""
    fresh, failed = failed_loads(db, model_line, version, now)
    if not fresh or len(failed) != fresh:
        return None
    return "; ".join(f"{node}: {why}" for node, why in failed.items())


def _implicating(versions: Sequence[Any], version: int, floor: int | None) -> tuple[dict[str, Any], str]:
    """The figures and the reason's tail of a rollback after a failed load of ``version``."""
    chain = implicated(versions, version, floor)
    since = f" since v{floor}" if floor is not None else ""
    tail = (f"; the versions on its chain{since}, {', '.join(f'v{v}' for v in chain)}, are rolled back with it "
            f"(ineligible until `flywheel rollout clear V`)" if chain else "")
    return {"failed_load": True, "implicated": chain}, tail


def _gates(registry: Any, db: Any, stable: int | None, policy: RolloutSettings) -> Callable[[Any], list[GateResult]]:
    def gate(info: Any) -> list[GateResult]:
        rows = held_out_rows(db, registry.model_line, [info.version] + ([stable] if stable is not None else []))
        return [held_out_gate(rows, info.version, stable, policy), parity_gate(info.metrics, policy)]
    return gate


def canary_started(transitions: Sequence[dict[str, Any]]) -> datetime | None:
    return max((t["at"] for t in transitions if t["to_status"] == "canary"), default=None)


def pinned_decision(pin: PinInfo, versions: Sequence[Any]) -> Decision:
    """A pinned line's decision: no change; names the candidates the pin holds back."""
    held = [v.version for v in versions if v.status == "candidate" and v.version > pin.version]
    waiting = f"; holding back candidates {', '.join(f'v{v}' for v in held)}" if held else ""
    return Decision("pinned", pin.version, f"model line pinned to {pin.describe()}; automatic rollout is frozen "
                                           f"until `flywheel rollout unpin`{waiting}",
                    {"pin": pin_figures(pin), "held": held})


def evaluate(registry: Any, sessions: Any, policy: RolloutSettings, now: datetime | None = None,
             metrics: Metrics | None = None) -> Decision:
    """The decision for this tick, without applying it (``flywheel rollout status`` shows it).
    ``metrics``: the deployment's (``Settings.product_metrics``); None: the built-in ones."""
    now = now or datetime.now(UTC)
    versions = registry.versions()
    pin = registry.pinned()
    if pin is not None:
        return pinned_decision(pin, versions)
    stable = max((v.version for v in versions if v.status == "stable"), default=None)
    canary = max((v for v in versions if v.status == "canary"), key=lambda v: v.version, default=None)
    for version, status in ((canary.version if canary else None, "canary"), (stable, "stable")):
        if version is None:
            continue
        with sessions() as db:  # its own session: SQLite's write lock must not outlive the read
            why = unloadable(db, registry.model_line, version, now)
            serving = fleet_version(db, registry.model_line, now) if why is not None else None
        if why is not None:
            if status == "canary":
                figures, tail = _implicating(versions, version, stable)
                return Decision("rollback", version, f"failed load: no node can load canary v{version}: {why}{tail}",
                                figures, status)
            restore = restore_after_failed_load(versions, registry.transitions(), version, serving)
            figures, tail = _implicating(versions, version, restore)
            back = f"; v{restore} restored" if restore is not None else ""
            return Decision("rollback", version, f"failed load: no node can load stable v{version}: {why}{back}{tail}",
                            {**figures, "restore": restore}, status)
    with sessions() as db:
        gate = _gates(registry, db, stable, policy)
        if canary is None:
            chosen, results = choose_candidate(versions, gate)
            blocked = {v: "; ".join(r.reason for r in rs if not r.ok) for v, rs in results.items() if v != chosen}
            figures = {"blocked": blocked} if blocked else {}
            if chosen is None:
                why = f"candidates blocked: {blocked}" if blocked else "no candidate newer than stable"
                return Decision("none", None, why, figures)
            gates = "; ".join(r.reason for r in results[chosen])
            if policy.canary_fraction > 0 and stable is not None:
                return Decision("canary", chosen, f"canary {policy.canary_fraction:.0%} vs v{stable}; {gates}", figures,
                                "candidate")
            why = "nothing stable yet" if stable is None else "canary_fraction 0"
            direct = Decision("promote", chosen, f"direct ({why}); {gates}", figures, "candidate")
            if stable is None:  # nothing serves yet: the calendar protects a stable version, and there is none
                return direct
            published = next(v.created_at for v in versions if v.version == chosen)
            return on_calendar(direct, "candidate", published, registry.model_line, db, policy, now)
        if stable is None:
            return Decision("promote", canary.version, "canary with no stable version to compare with", {}, "canary")
        since = canary_started(registry.transitions(canary.version)) or canary.created_at
        failed = [r for r in gate(canary) if not r.ok]
        verdict = judge_canary(version_sample(db, registry.model_line, canary.version, since),
                               version_sample(db, registry.model_line, stable, since),
                               (now - since).total_seconds(), policy)
        unserved = verdict.action == "rollback" and verdict.figures["canary"]["generations"] == 0
        _, refused = failed_loads(db, registry.model_line, canary.version, now) if unserved else (0, {})
        metrics = metrics or Metrics()
        gates = promotion_policy(policy, metrics)
        evidence = (look(db, gates, metrics, registry.model_line, canary.version, stable, since, now)
                    if gates is not None else None)
    figures = verdict.figures if evidence is None else {
        **verdict.figures, "evidence": evidence_figures(evidence, canary.version, since)}
    if refused:  # it served nothing and nodes failed to load it: a failed load too (step 4)
        implicating, tail = _implicating(versions, canary.version, stable)
        why = "; ".join(f"{node}: {reason}" for node, reason in refused.items())
        return Decision("rollback", canary.version, f"failed load: canary v{canary.version} vs v{stable}: "
                        f"{verdict.reason}; failed to load it: {why}{tail}", {**figures, **implicating}, "canary")
    if failed:  # the held-out gate, now that the canary served traffic (or a stricter policy)
        return Decision("rollback", canary.version, "gate failed: " + "; ".join(r.reason for r in failed),
                        figures, "canary")
    action, reason = verdict.action, verdict.reason
    if evidence is not None and not unserved:  # the gates decide (step 2, on evidence)
        action, reason = on_evidence(evidence, (now - since).total_seconds(), policy.window_s)
    decision = Decision(action, canary.version, f"canary v{canary.version} vs v{stable}: {reason}", figures, "canary")
    if decision.action != "promote":
        return decision
    with sessions() as db:
        return on_calendar(decision, "canary", since, registry.model_line, db, policy, now)


def on_evidence(evidence: EvidenceDecision, elapsed_s: float, window_s: float) -> tuple[str, str]:
    """The canary's action when the line has gates (module docstring, step 2): theirs, except that a
    promotion also waits for ``window_s``."""
    if evidence.action == "promote" and elapsed_s < window_s:
        return "wait", f"window {elapsed_s:.0f}/{window_s:.0f}s; {evidence.reason}"
    return evidence.action, evidence.reason


#: Audit reasons of the controller's own status changes start so (:func:`step`); one that starts
#: ``rollout: restored`` is a rollback's restore (:func:`roll_back_stable`), not a promotion.
AUTOMATIC = "rollout: "
RESTORE = "rollout: restored"


def automatic_promotions(db: Any, model_line: str, since: datetime) -> list[datetime]:
    """When the controller promoted a version of the line to stable since ``since``: the
    ``version_transitions`` from ``candidate`` or ``canary`` to ``stable`` with the controller's
    reason (:data:`AUTOMATIC`). Operators' promotions and pins, and the restores of rollbacks, are
    not counted (``rollout.max_promotions_per_day`` paces the controller; README, "Rollout")."""
    from sqlalchemy import select

    from flywheel.db.models import VersionTransition as T

    query = select(T.at).where(T.model_line == model_line, T.to_status == "stable", T.at >= since,
                               T.from_status.in_(("candidate", "canary")), T.reason.startswith(AUTOMATIC),
                               ~T.reason.startswith(RESTORE))
    return list(db.scalars(query))


def on_calendar(decision: Decision, kind: str, soak_start: datetime, model_line: str, db: Any,
                policy: RolloutSettings, now: datetime) -> Decision:
    """``decision`` (a promotion of a ready ``kind``, ``canary`` or ``candidate``) if the release
    calendar (serving/rollout_calendar.py) allows it at ``now``; otherwise a ``wait`` that says why
    and when the next opportunity is, with the calendar's figures."""
    calendar = Calendar.of(policy)
    if not calendar.rules:
        return decision
    verdict = check(calendar, now, automatic_promotions(db, model_line, now - timedelta(days=2)), soak_start)
    figures = {**decision.figures, "calendar": verdict.figures}
    if verdict.ok:
        return replace(decision, figures=figures)
    return Decision("wait", decision.version, f"ready {kind} v{decision.version} waits: {verdict.reason}", figures,
                    decision.was)


_STATUS_OF = {"canary": "canary", "promote": "stable", "rollback": "rolled_back"}


def step(registry: Any, sessions: Any, policy: RolloutSettings,
         notify: Callable[[VersionEvent], None] | None = None, now: datetime | None = None,
         metrics: Metrics | None = None) -> Decision:
    """Decide (:func:`evaluate`), log the decision with its figures, apply and announce it."""
    decision = evaluate(registry, sessions, policy, now, metrics)
    if decision.action == "rollback" and decision.figures.get("implicated"):
        roll_back_implicated(registry, decision, notify)
    if decision.changed and decision.was == "stable":  # no node can load it: restore what the fleet serves
        assert decision.version is not None
        try:
            changed = roll_back_stable(registry, decision.version, decision.figures.get("restore"),
                                       f"rollout: {decision.reason}")
        except RolloutError as exc:  # nothing to restore, or an operator acted meanwhile
            log.error("rollout: cannot roll back stable v%d: %s", decision.version, exc)
            return Decision("none", decision.version, str(exc))
        log.warning("rollout: v%d -> rolled_back, v%d restored: %s", decision.version, changed[0], decision.reason)
        if notify is not None:
            for version in changed:
                notify(version_event(registry.get(version)))
    elif decision.changed:
        assert decision.version is not None
        try:
            registry.set_status(decision.version, _STATUS_OF[decision.action], reason=f"rollout: {decision.reason}",
                                expect=decision.was)
        except StatusChanged as exc:  # an operator moved it (or pinned the line) meanwhile: decide again next tick
            log.warning("rollout: skipping %s of v%d: %s", decision.action, decision.version, exc)
            return Decision("none", decision.version, str(exc))
        log.info("rollout: v%d -> %s: %s", decision.version, _STATUS_OF[decision.action], decision.reason)
        if notify is not None:
            notify(version_event(registry.get(decision.version)))
    else:  # "none" with nothing to look at is every quiet tick: DEBUG
        level = logging.DEBUG if decision.action == "none" and not decision.figures else logging.INFO
        log.log(level, "rollout: %s%s: %s", decision.action,
                f" v{decision.version}" if decision.version is not None else "", decision.reason)
    return decision


def roll_back_stable(registry: Any, version: int, restore: int | None, reason: str) -> list[int]:
    """Make ``restore`` stable (which retires ``version``), then ``version`` ``rolled_back``; the
    versions changed. :class:`RolloutError` when ``version`` is no longer stable, there is nothing to
    restore, or someone moved either meanwhile (or pinned the line)."""
    if registry.get(version).status != "stable":
        raise RolloutError(f"v{version} is no longer stable")
    if restore is None:
        raise RolloutError(f"no earlier stable version (not rolled back or collected) to restore instead of v{version}")
    try:
        registry.set_status(restore, "stable", reason=f"rollout: restored instead of v{version}: {reason}")
        registry.set_status(version, "rolled_back", reason=reason, expect="retired")
    except StatusChanged as exc:
        raise RolloutError(f"v{version} changed meanwhile: {exc}") from None
    return [restore, version]


def roll_back_implicated(registry: Any, decision: Decision,
                         notify: Callable[[VersionEvent], None] | None = None) -> list[int]:
    """Move the versions a failed load implicates (``decision.figures["implicated"]``) to
    ``rolled_back``, each only while it still has a status a failed load implicates
    (:data:`~serving.rollout_policy.IMPLICABLE`), audited with the failed load; returns them."""
    moved: list[int] = []
    for version in decision.figures["implicated"]:
        reason = (f"rollout: implicated in a failed load: the chain of {decision.was} v{decision.version} runs "
                  f"through v{version}; ineligible until `flywheel rollout clear v{version}` re-verifies it; "
                  f"{decision.reason}")
        was = registry.get(version).status
        if was not in IMPLICABLE:
            continue
        try:
            registry.set_status(version, "rolled_back", reason=reason, expect=was)
        except StatusChanged as exc:  # an operator moved it (or pinned the line) meanwhile
            log.warning("rollout: leaving v%d implicated by v%s's failed load: %s", version, decision.version, exc)
            continue
        log.warning("rollout: v%d -> rolled_back: implicated in the failed load of v%s", version, decision.version)
        moved.append(version)
        if notify is not None:
            notify(version_event(registry.get(version)))
    return moved


def tick(registry: Any, notify: Callable[[VersionEvent], None] | None = None, rollout: RolloutSettings | None = None,
         sessions: Any = None, now: datetime | None = None, metrics: Metrics | None = None) -> int | None:
    """One :func:`step`; returns the version whose status changed, if any.

    ``rollout`` None: the default policy without a canary (gated candidates go straight to
    stable). ``sessions`` None: the registry's own session factory (same database).
    """
    policy = rollout if rollout is not None else RolloutSettings(canary_fraction=0.0)
    decision = step(registry, sessions if sessions is not None else registry.sessions, policy, notify, now, metrics)
    return decision.version if decision.changed else None


def open_line(settings: Settings) -> tuple[Any, Any, Any]:
    from flywheel.db.session import make_session_factory, open_database
    from flywheel.weights.registry import Registry
    from flywheel.weights.store import make_store

    db = open_database(settings.database_url, settings.db.wait_s)
    sessions = make_session_factory(db)
    return db, sessions, Registry(sessions, make_store(settings), settings.model.line, announce=node_waker(settings))


def run(settings: Settings, stop: threading.Event | None = None) -> None:
    """Decide on schedule until ``stop`` is set."""
    from flywheel.bus import make_bus

    db, sessions, registry = open_line(settings)
    bus = make_bus(settings)
    topic = settings.topic(VersionEvent.topic)
    bus.ensure_topics([topic])
    producer = bus.producer()

    def notify(event: VersionEvent) -> None:
        producer.send(topic, event.session_id, event.to_bytes())
        producer.flush()

    stop = stop or threading.Event()
    # `flywheel health rollout`: the wait between decisions (hours in production) is cut into
    # slices of at most BEAT_EVERY_S, each followed by a beat; a wedged decision stops the beats.
    heartbeat = Beat(settings, "rollout")
    try:
        while not stop.is_set():
            heartbeat.beat()
            record(sessions, settings.model.line,
                   step(registry, sessions, settings.rollout, notify, metrics=settings.product_metrics()))
            heartbeat.beat()
            due = time.monotonic() + settings.rollout.interval_s
            while not stop.wait(max(0.0, min(BEAT_EVERY_S, due - time.monotonic()))) and time.monotonic() < due:
                heartbeat.beat()
    finally:
        heartbeat.close()
        producer.close()
        bus.close()
        db.dispose()


def calendar_report(registry: Any, sessions: Any, policy: RolloutSettings, decision: Decision,
                    now: datetime) -> dict[str, Any]:
    """The release calendar at ``now`` (:func:`~serving.rollout_calendar.check`'s figures: open
    now, the next window, freezes, today's automatic promotions), and ``holding``: the version a
    ready promotion waits for and why, when the calendar holds ``decision``."""
    held = decision.action == "wait" and "calendar" in decision.figures
    if "calendar" in decision.figures:
        figures = decision.figures["calendar"]
    else:
        with sessions() as db:
            promotions = automatic_promotions(db, registry.model_line, now - timedelta(days=2))
        figures = check(Calendar.of(policy), now, promotions).figures
    return {**figures, "holding": {"version": decision.version, "reason": decision.reason} if held else None}


def status_report(registry: Any, sessions: Any, policy: RolloutSettings, limit: int = 20,
                  metrics: Metrics | None = None) -> dict[str, Any]:
    versions = registry.versions()
    keep = {v.version for v in versions[-limit:]} | {v.version for v in versions if v.status in ("stable", "canary")}
    pin = registry.pinned()
    now = datetime.now(UTC)
    decision = evaluate(registry, sessions, policy, now, metrics)
    return {
        "model_line": registry.model_line,
        "pin": pin_figures(pin) if pin is not None else None,
        "versions": [{"version": v.version, "status": v.status, "kind": v.kind, "created_at": v.created_at.isoformat()}
                     for v in versions if v.version in keep],
        "next_decision": asdict(decision),
        "calendar": calendar_report(registry, sessions, policy, decision, now),
    }
