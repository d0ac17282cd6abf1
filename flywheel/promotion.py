"""Promotion gates as ``rollout.must_win`` and ``rollout.must_not_lose`` write them, checked against the metrics.

A gate names a product metric (built-in or declared in ``[metrics]``, flywheel/metrics.py) that a
canary is judged on against stable (serving/rollout_evidence.py has the statistics,
serving/rollout_metrics.py the data):

    [[rollout.must_win]]       # the canary must be better by at least min_effect
    metric = "task_solved"
    min_effect = 0.02          # in the metric's units; a rate's is an absolute difference
    alpha = 0.05               # the always-valid test's significance
    # mixing_sd = 0.05         # the mixture's scale: needed when min_effect is 0

    [[rollout.must_not_lose]]  # the canary may not be worse by more than tolerance
    metric = "thumbs"
    tolerance = 0.05

Invariants: a gate's metric exists, has a value (``boolean`` or ``float``, not ``comment``) and a
direction (which way is better); a metric appears at most once per role; a margin of 0 needs a
``mixing_sd``; a boolean's margin is below 1. :func:`check_gates` raises ``ValueError`` naming the
offending field, so settings fail at load time, never at the controller's first look.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from flywheel.metrics import BUILTIN, Metric, Metrics


class Gate(BaseModel):
    """What every gate has: the metric, the significance and the mixture's scale."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    metric: str = Field(min_length=1)
    #: The always-valid test's significance (the chance an equal canary ever passes the gate).
    alpha: float = Field(0.05, gt=0, lt=0.5)
    #: The mixture's scale tau, in the metric's units (serving/rollout_evidence.py); none: the margin.
    mixing_sd: float | None = Field(None, gt=0)

    @property
    def margin(self) -> float:
        raise NotImplementedError


class MustWin(Gate):
    """The canary must be better than stable by at least ``min_effect``."""

    min_effect: float = Field(0.0, ge=0)

    @property
    def margin(self) -> float:
        return self.min_effect


class MustNotLose(Gate):
    """The canary may not be worse than stable by more than ``tolerance``."""

    tolerance: float = Field(0.0, ge=0)

    @property
    def margin(self) -> float:
        return self.tolerance


def gated_metric(gate: Gate, metrics: Metrics) -> Metric:
    """The metric ``gate`` names, or ``ValueError`` saying why it cannot be gated on."""
    found = metrics.get(gate.metric)
    if found is None:
        known = ", ".join(sorted(metrics.declared)) or "none"
        raise ValueError(f"unknown metric {gate.metric!r}: declared metrics are {known}; built-in ones "
                         f"{', '.join(BUILTIN)}")
    d = found.declaration
    if d.type == "comment" or d.direction is None:
        raise ValueError(f"metric {gate.metric!r} is a {d.type} without a direction: a gate needs a boolean or "
                         "float metric that is better one way")
    return found


def check_gates(must_win: Sequence[MustWin], must_not_lose: Sequence[MustNotLose], metrics: Metrics) -> None:
    """Every gate is one the controller can judge (module docstring), or ``ValueError`` naming it."""
    for role, gates in (("must_win", must_win), ("must_not_lose", must_not_lose)):
        seen: set[str] = set()
        margin_name = "min_effect" if role == "must_win" else "tolerance"
        for i, gate in enumerate(gates):
            where = f"rollout.{role}[{i}]"
            try:
                metric = gated_metric(gate, metrics)
            except ValueError as exc:
                raise ValueError(f"{where}.metric: {exc}") from None
            if gate.metric in seen:
                raise ValueError(f"{where}.metric: {gate.metric!r} is gated twice as {role}")
            seen.add(gate.metric)
            if gate.margin == 0 and gate.mixing_sd is None:
                raise ValueError(f"{where}: with {margin_name} 0 there is no scale to tie the test to; set mixing_sd "
                                 "to the smallest effect worth detecting quickly")
            if metric.declaration.type == "boolean" and gate.margin >= 1:
                raise ValueError(f"{where}.{margin_name}: a rate's {margin_name} is an absolute difference below 1")
