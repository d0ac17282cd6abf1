"""A canary's product-metric gates on live data: the policy from settings, each arm's sessions, the previous look.

The rollout controller (serving/rollout.py) asks :func:`look` every tick while a canary runs and
the line has gates (``rollout.must_win`` / ``rollout.must_not_lose``, flywheel/promotion.py):

- the **policy** (:func:`promotion_policy`): one :class:`~serving.rollout_evidence.MetricGate` per
  configured gate, its kind and direction from the metric's declaration. Observations are per
  session (flywheel/db/observed.py), so a session-level boolean is a rate of sessions
  (``boolean``) and everything else a mean of per-session values (``float``). Every arm needs
  ``rollout.min_samples`` sessions with a value of a metric before a look at it counts;
- the **arms**: the sessions the canary and stable served since the canary started
  (``observe``), both over the same window;
- the **previous look**: the always-valid p-values and bounds run on from the last look (they
  never rise, or narrow back), so the controller's last recorded decision
  (serving/rollout_record.py) carries the evidence figures with the canary and its start, and a
  look continues from them only when both match (a canary canaried again after a pin starts afresh).
  A tick whose record failed loses one look's running state, which only delays a verdict.

Invariants: reads only; the statistics are serving/rollout_evidence.py's, untouched here.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from flywheel.db.observed import observe
from flywheel.metrics import Metrics
from flywheel.promotion import gated_metric
from flywheel.settings import RolloutSettings
from serving.rollout_evidence import ArmStats, EvidenceDecision, MetricGate, PromotionPolicy, decide_on_evidence
from serving.rollout_record import last_decision


def promotion_policy(rollout: RolloutSettings, metrics: Metrics) -> PromotionPolicy | None:
    """The line's promotion policy, or None when it has no gate (module docstring)."""
    gates = []
    for role, configured in (("must_win", rollout.must_win), ("must_not_lose", rollout.must_not_lose)):
        for gate in configured:
            d = gated_metric(gate, metrics).declaration
            kind = "boolean" if d.type == "boolean" and d.level == "session" else "float"
            assert d.direction is not None  # gated_metric checked it
            gates.append(MetricGate(gate.metric, kind, d.direction, role, gate.margin, gate.alpha, gate.mixing_sd))
    if not gates:
        return None
    return PromotionPolicy(tuple(gates), rollout.max_window_s, max(2, rollout.min_samples))


def previous_look(db: Any, model_line: str, canary: int, since: datetime) -> EvidenceDecision | None:
    """The evidence of the controller's last recorded decision, if it was about this canary run."""
    last = last_decision(db, model_line)
    evidence = (last or {}).get("figures", {}).get("evidence")
    if not evidence or evidence.get("canary") != canary or evidence.get("since") != since.isoformat():
        return None
    return EvidenceDecision.from_figures(evidence)


def look(db: Any, policy: PromotionPolicy, metrics: Metrics, model_line: str, canary: int, stable: int,
         since: datetime, now: datetime) -> EvidenceDecision:
    """This tick's look at the gates, continuing from the previous one."""
    arms: dict[int, dict[str, ArmStats]] = {canary: {}, stable: {}}
    for gate in policy.gates:
        metric = metrics.get(gate.metric)
        assert metric is not None  # promotion_policy built the gate from it
        observed = observe(db, metric, model_line, [canary, stable], since)
        for version, o in observed.items():
            arms[version][gate.metric] = ArmStats(o.n, o.total, o.total_sq)
    return decide_on_evidence(policy, arms[canary], arms[stable], (now - since).total_seconds(),
                              previous_look(db, model_line, canary, since))


def evidence_figures(decision: EvidenceDecision, canary: int, since: datetime) -> dict[str, Any]:
    """What a decision's figures carry of the evidence: the verdicts, and the run they belong to."""
    return {"canary": canary, "since": since.isoformat(), **decision.figures()}
