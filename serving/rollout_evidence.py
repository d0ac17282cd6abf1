"""Promotion on evidence, pure: always-valid sequential tests of canary - stable, gate verdicts, the decision.

The rollout controller looks at a canary every tick, so any test it runs is *peeked at*
continuously and stopped on the data: a fixed-sample z-test read that way promotes an equal canary
far more often than its alpha says (tests/unit/test_rollout_evidence.py measures it). This module's
tests stay valid under any look schedule and any data-dependent stopping time.

**Which sequential test, and why.** The mixture sequential probability ratio test (mSPRT; Robbins'
normal mixture, as Johari, Koomen, Pekelis and Walsh use it for A/B tests in "Always valid
inference: continuous monitoring of A/B tests", 2017/2022), not a group-sequential design. A
group-sequential design (Pocock, O'Brien-Fleming, or an alpha-spending function) needs the maximum
information and the looks' information fractions planned in advance; the controller looks on a
clock, traffic (and so the sample between looks) varies, and nobody knows the final sample size.
The mSPRT's error bound holds at every stopping time, for every look schedule, with no horizon: the
maximum window is just one more stopping time. What it costs: for the same power it needs more
samples than a group-sequential design tuned to a known horizon (roughly 1.5-3x a fixed-sample test),
and its intervals are wider.

**The statistic.** For one metric with cumulative counts, sums and sums of squares per arm, the
estimate of the difference is ``d = mean_c - mean_s`` with variance ``V = var_c / n_c + var_s / n_s``.
With known variances, ``Z = (d - theta) / V`` is a Brownian motion in information time ``I = 1/V``
(``Cov(d_s, d_t) = V_t`` for ``s < t``, whatever the split of traffic between the arms), so for the
standardised ``w = (d - theta0) / sqrt(V)`` and ``r = tau^2 / V`` the mixture over alternatives
``theta = theta0 + delta``, ``delta ~ N(0, tau^2)`` restricted to ``delta > 0`` (a half-normal: the
gates are one-sided, so no alpha is spent on the other side) has the closed form

    log L = log 2 - log(1 + r) / 2 + w^2 r / (2 (1 + r)) + log Phi(w sqrt(r / (1 + r)))

(:func:`mixture_log_lr`). L is a nonnegative martingale under ``theta = theta0`` and a
supermartingale under every ``theta < theta0``, so by Ville's inequality P(L ever reaches 1/alpha) <=
alpha for the whole composite null ``theta <= theta0``. Hence

- the always-valid p-value ``p_t = min(p_{t-1}, 1 / L_t)`` (:func:`always_valid_p`; the caller
  passes the previous one, so it never rises), and
- the always-valid one-sided confidence bound ``lower_t = d - w* sqrt(V)`` where ``w*`` solves
  ``L(w*) = 1/alpha`` (:func:`confidence_bound`); its running maximum is still valid, and
  ``max lower > m`` exactly when ``p <= alpha`` for the null at m. The mirror gives the upper bound.
  Each bound alone covers with probability >= 1 - alpha at all times; the pair with 1 - 2 alpha.

**Plug-in variance, and what it costs.** The variances are not known: each look uses the sample
variance (a rate's ``p(1 - p)`` with the Laplace-smoothed ``p = (x + 1) / (n + 2)``, so all-zero or
all-one arms still have spread; a mean's unbiased sample variance) as if it were the truth, and the
normal model of a mean as if the central limit theorem had already set in. The guarantee is
therefore asymptotic, not exact: small samples, rare events and heavy tails can push the real error
above alpha. So no look counts (no p-value, no bound, no decision) until each arm has
``min_samples`` observations of the metric, and an arm pair with no spread at all (``V = 0``) decides
nothing. The tests measure the real error rates at the sizes the controller sees. The observations
of a metric must also be independent units: a per-generation rate from long sessions is clustered,
its real variance larger than the plug-in one, and its error rates higher (prefer per-session
metrics there).

**The mixing scale tau.** The mixture is tightest (the test fastest) for a true effect about
``tau`` beyond the null. A must_win gate with minimum effect ``m > 0`` is designed to detect a true
effect of ``2 m`` (a distance ``m`` beyond its null), so ``tau`` defaults to ``m``; a must_not_lose
gate with tolerance ``t > 0`` to catch a canary worse by ``2 t``, so ``tau`` defaults to ``t``. With a
margin of 0 there is no scale to tie it to, and the gate must name ``mixing_sd`` (the smallest
effect the team cares to detect quickly, in the metric's units). A wrong tau costs speed, never
validity.

**Gates.** A metric is ``boolean`` (a rate: per generation or per session) or ``float`` (a mean), and
better when larger (``max``) or smaller (``min``); the gain is the difference signed so that larger
is better. ``must_win`` with minimum effect m: "win" once ``p <= alpha`` against H0: gain <= m (the
point null shifted to m; the half-normal mixture makes it a test of the whole one-sided null, m being
its least favourable point), i.e. once the running lower bound of the gain exceeds m.
``must_not_lose`` with tolerance t: "lose" once ``p <= alpha`` against H0: gain >= -t, i.e. once the
running upper bound of the gain falls below -t. Otherwise "undecided". Verdicts are sticky (the
p-value never rises). Figures are reported in the metric's own units, canary minus stable.

**The decision** (:func:`decide_on_evidence`): roll back at once when any must_not_lose gate lost
("worse"); promote when every must_win gate won and every gate has its minimum sample; roll back
with "no evidence of a win" when the maximum window has passed without that; otherwise wait. A
policy with no must_win gate promotes when the window closes with nothing lost.

Invariants: pure (numpy and math only); the math accepts arrays (the tests simulate thousands of
canaries at once); the state between ticks is the previous :class:`MetricVerdict` per gate, and
:meth:`MetricVerdict.to_dict` / :meth:`MetricVerdict.from_dict` round-trip it through JSON.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

KINDS = ("boolean", "float")
DIRECTIONS = ("max", "min")
ROLES = ("must_win", "must_not_lose")
OUTCOMES = ("win", "lose", "undecided")
#: Bisection steps for a confidence bound: the bracket is narrower than 1, so 2^-40 of it.
BOUND_STEPS = 40

# --- the sequential test (pure; arrays in, arrays out) ---------------------------------------------

_ERFC = np.frompyfunc(math.erfc, 1, 1)


def normal_cdf(x: Any) -> np.ndarray:
    """Phi(x) elementwise, exact to double precision (``math.erfc``; numpy has no erf)."""
    return 0.5 * np.asarray(_ERFC(-np.asarray(x, dtype=np.float64) / math.sqrt(2.0)), dtype=np.float64)


def arm_variance(kind: str, n: Any, total: Any, total_sq: Any) -> np.ndarray:
    """One arm's plug-in variance of a single observation (module docstring): a rate's
    ``p (1 - p)`` with ``p = (x + 1) / (n + 2)``; a mean's unbiased sample variance from the sums
    (0 below two observations)."""
    n = np.asarray(n, dtype=np.float64)
    total = np.asarray(total, dtype=np.float64)
    if kind == "boolean":
        p = (total + 1.0) / (n + 2.0)
        return p * (1.0 - p)
    if kind != "float":
        raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
    safe = np.maximum(n, 2.0)
    spread = np.asarray(total_sq, dtype=np.float64) - total * total / np.maximum(n, 1.0)
    return np.where(n >= 2, np.maximum(spread, 0.0) / (safe - 1.0), 0.0)


def plug_in_difference(kind: str, n_c: Any, sum_c: Any, sumsq_c: Any, n_s: Any, sum_s: Any, sumsq_s: Any
                       ) -> tuple[np.ndarray, np.ndarray]:
    """The estimate ``mean_c - mean_s`` and its plug-in variance ``var_c / n_c + var_s / n_s``
    from each arm's count, sum and sum of squares (for a rate: successes twice). Needs n >= 1."""
    n_c, n_s = np.asarray(n_c, dtype=np.float64), np.asarray(n_s, dtype=np.float64)
    estimate = np.asarray(sum_c, dtype=np.float64) / n_c - np.asarray(sum_s, dtype=np.float64) / n_s
    variance = arm_variance(kind, n_c, sum_c, sumsq_c) / n_c + arm_variance(kind, n_s, sum_s, sumsq_s) / n_s
    return estimate, variance


def mixture_log_lr(w: Any, r: Any) -> np.ndarray:
    """log of the one-sided (half-normal) mixture likelihood ratio at the standardised distance
    ``w = (d - theta0) / sqrt(V)`` beyond the null and ``r = tau^2 / V`` (module docstring).
    Needs ``w >= 0`` (below that the ratio is at most 1, and a test reads it as no evidence)."""
    w, r = np.asarray(w, dtype=np.float64), np.asarray(r, dtype=np.float64)
    shrink = r / (1.0 + r)
    return (math.log(2.0) - 0.5 * np.log1p(r) + 0.5 * w * w * shrink
            + np.log(normal_cdf(w * np.sqrt(shrink))))


def always_valid_p(estimate: Any, variance: Any, null: Any, mixing_sd: Any, alternative: str = "greater"
                   ) -> np.ndarray:
    """This look's always-valid p-value ``min(1, 1 / L)`` of H0: effect <= ``null`` against
    "greater" (or H0: effect >= ``null`` against "less"); the caller keeps the running minimum.
    A look with no variance is no evidence (p = 1)."""
    if alternative not in ("greater", "less"):
        raise ValueError(f"alternative must be 'greater' or 'less', not {alternative!r}")
    sign = 1.0 if alternative == "greater" else -1.0
    variance = np.asarray(variance, dtype=np.float64)
    informative = variance > 0
    sd = np.sqrt(np.where(informative, variance, 1.0))
    w = sign * (np.asarray(estimate, dtype=np.float64) - np.asarray(null, dtype=np.float64)) / sd
    r = np.asarray(mixing_sd, dtype=np.float64) ** 2 / sd**2
    log_lr = mixture_log_lr(np.maximum(w, 0.0), r)
    return np.where(informative & (w > 0), np.minimum(1.0, np.exp(-log_lr)), 1.0)


def _two_sided_w(r: np.ndarray, level: float) -> np.ndarray:
    """Where the symmetric normal mixture ``(1 + r)^-1/2 exp(w^2 r / (2 (1 + r)))`` reaches ``level``."""
    return np.sqrt((1.0 + r) / r * (2.0 * math.log(level) + np.log1p(r)))


def confidence_bound(estimate: Any, variance: Any, mixing_sd: Any, alpha: float, bound: str = "lower") -> np.ndarray:
    """This look's always-valid one-sided (1 - alpha) bound on the effect: ``d - w* sqrt(V)`` for
    "lower", ``d + w* sqrt(V)`` for "upper", with ``L(w*) = 1/alpha`` found by bisection between the
    symmetric mixture's crossings of 1/(2 alpha) and 1/alpha (the half-normal one lies between).
    Infinite where there is no variance; the caller keeps the running maximum (minimum)."""
    if not 0 < alpha < 0.5:
        raise ValueError(f"alpha must lie in (0, 0.5), not {alpha}")
    if bound not in ("lower", "upper"):
        raise ValueError(f"bound must be 'lower' or 'upper', not {bound!r}")
    estimate, variance, tau = np.broadcast_arrays(*(np.asarray(x, dtype=np.float64) for x in (estimate, variance, mixing_sd)))
    informative = variance > 0
    sd = np.sqrt(np.where(informative, variance, 1.0))
    r = tau**2 / sd**2
    low, high = _two_sided_w(r, 0.5 / alpha), _two_sided_w(r, 1.0 / alpha)
    target = math.log(1.0 / alpha)
    for _ in range(BOUND_STEPS):
        mid = 0.5 * (low + high)
        reached = mixture_log_lr(mid, r) >= target
        high, low = np.where(reached, mid, high), np.where(reached, low, mid)
    if bound == "lower":
        return np.where(informative, estimate - high * sd, -np.inf)
    return np.where(informative, estimate + high * sd, np.inf)


# --- what the caller passes ------------------------------------------------------------------------


@dataclass(frozen=True)
class ArmStats:
    """One arm's cumulative observations of one metric: count, sum and sum of squares."""

    n: int
    total: float  # sum of values (successes, for a rate)
    total_sq: float  # sum of squared values (= total, for a rate)

    @classmethod
    def from_counts(cls, successes: int, n: int) -> ArmStats:
        if not 0 <= successes <= n:
            raise ValueError(f"successes must lie in [0, n], not {successes} of {n}")
        return cls(int(n), float(successes), float(successes))

    @classmethod
    def from_values(cls, values: Any) -> ArmStats:
        v = np.asarray(values, dtype=np.float64)
        return cls(int(v.size), float(v.sum()), float((v * v).sum()))

    def __add__(self, other: ArmStats) -> ArmStats:
        return ArmStats(self.n + other.n, self.total + other.total, self.total_sq + other.total_sq)

    @property
    def mean(self) -> float:
        return self.total / self.n if self.n else math.nan


@dataclass(frozen=True)
class MetricGate:
    """One gate of a promotion policy (module docstring, Gates)."""

    metric: str
    kind: str  # boolean | float
    direction: str  # max | min: which way is better
    role: str  # must_win | must_not_lose
    #: must_win: the minimum effect m the canary must beat stable by; must_not_lose: the tolerance.
    #: Both >= 0, in the metric's units (a rate's absolute difference), in the better direction.
    margin: float = 0.0
    alpha: float = 0.05
    #: The mixture's tau (module docstring); None: the margin, which must then be > 0.
    mixing_sd: float | None = None

    def __post_init__(self) -> None:
        for name, value, allowed in (("kind", self.kind, KINDS), ("direction", self.direction, DIRECTIONS),
                                     ("role", self.role, ROLES)):
            if value not in allowed:
                raise ValueError(f"gate {self.metric!r}: {name} must be one of {allowed}, not {value!r}")
        if not (math.isfinite(self.margin) and self.margin >= 0):
            raise ValueError(f"gate {self.metric!r}: margin must be a finite number >= 0, not {self.margin}")
        if self.kind == "boolean" and self.margin >= 1:
            raise ValueError(f"gate {self.metric!r}: a rate's margin is an absolute difference below 1")
        if not 0 < self.alpha < 0.5:
            raise ValueError(f"gate {self.metric!r}: alpha must lie in (0, 0.5), not {self.alpha}")
        if self.mixing_sd is None and self.margin == 0:
            raise ValueError(f"gate {self.metric!r}: with a margin of 0 there is no scale to tie the mixture to; "
                             "set mixing_sd to the smallest effect worth detecting quickly")
        if self.mixing_sd is not None and not (math.isfinite(self.mixing_sd) and self.mixing_sd > 0):
            raise ValueError(f"gate {self.metric!r}: mixing_sd must be a finite number > 0, not {self.mixing_sd}")

    @property
    def tau(self) -> float:
        return self.margin if self.mixing_sd is None else self.mixing_sd

    @property
    def key(self) -> str:
        return f"{self.role}:{self.metric}"

    @property
    def null(self) -> str:
        """H0 in the metric's own units, canary minus stable."""
        sign = 1.0 if self.direction == "max" else -1.0
        if self.role == "must_win":
            return f"effect {'<=' if sign > 0 else '>='} {sign * self.margin:+.4g}"
        return f"effect {'>=' if sign > 0 else '<='} {-sign * self.margin:+.4g}"


@dataclass(frozen=True)
class PromotionPolicy:
    """A canary's gates, the most it may run, and the sample every arm needs before any look counts."""

    gates: tuple[MetricGate, ...]
    max_window_s: float
    min_samples: int = 100  # per arm and metric

    def __post_init__(self) -> None:
        if not self.gates:
            raise ValueError("a promotion policy needs at least one gate")
        keys = [g.key for g in self.gates]
        if len(set(keys)) != len(keys):
            raise ValueError(f"gates repeat a (role, metric): {keys}")
        if not self.max_window_s > 0:
            raise ValueError(f"max_window_s must be > 0, not {self.max_window_s}")
        if self.min_samples < 2:
            raise ValueError(f"min_samples must be >= 2 (a variance needs two observations), not {self.min_samples}")


# --- verdicts --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MetricVerdict:
    """One gate's verdict at one look, and the running state the next look continues from."""

    metric: str
    role: str
    outcome: str  # win | lose | undecided
    effect: float  # canary mean - stable mean, this look (nan before both arms have data)
    lower: float  # the running always-valid interval for the effect (each side at alpha; -inf/inf: none yet)
    upper: float
    p: float  # the running always-valid p-value against the gate's null (MetricGate.null)
    n_canary: int
    n_stable: int
    mean_canary: float = math.nan
    mean_stable: float = math.nan
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe: non-finite figures become None."""
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in self.__dict__.items()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MetricVerdict:
        absent = {"effect": math.nan, "lower": -math.inf, "upper": math.inf, "p": 1.0,
                  "mean_canary": math.nan, "mean_stable": math.nan}
        return cls(**{k: (absent[k] if v is None and k in absent else v) for k, v in data.items()})


def _figure(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:+.4g}" if math.isfinite(x) else ("-inf" if x < 0 else "+inf")


def _describe(gate: MetricGate, v: MetricVerdict) -> str:
    level = 1 - 2 * gate.alpha
    means = (f"canary {v.mean_canary:.4g} (n={v.n_canary}) vs stable {v.mean_stable:.4g} (n={v.n_stable})"
             if v.n_canary and v.n_stable else f"canary n={v.n_canary}, stable n={v.n_stable}")
    return (f"{gate.metric} {gate.role} ({gate.direction}): {means}; effect {_figure(v.effect)} "
            f"[{_figure(v.lower)}, {_figure(v.upper)}] (always-valid {level:.0%}); "
            f"p={v.p:.3g} against {gate.null} (alpha {gate.alpha:g}): {v.outcome}")


def judge_metric(gate: MetricGate, canary: ArmStats, stable: ArmStats, min_samples: int,
                 previous: MetricVerdict | None = None) -> MetricVerdict:
    """One look at one gate, continuing from its ``previous`` verdict (None at the first look)."""
    if previous is not None and (previous.metric, previous.role) != (gate.metric, gate.role):
        raise ValueError(f"previous verdict is for {previous.role}:{previous.metric}, not {gate.key}")
    p_run = previous.p if previous else 1.0
    low_run = previous.lower if previous else -math.inf
    high_run = previous.upper if previous else math.inf
    effect = canary.mean - stable.mean if canary.n and stable.n else math.nan
    base = MetricVerdict(gate.metric, gate.role, "undecided", effect, low_run, high_run, p_run, canary.n, stable.n,
                         canary.mean, stable.mean)
    if canary.n < min_samples or stable.n < min_samples:
        waiting = replace(base, outcome=_outcome(gate, p_run))
        return replace(waiting, reason=f"{_describe(gate, waiting)}; this look does not count (fewer than "
                                       f"min_samples {min_samples} per arm)")
    estimate, variance = (float(x) for x in plug_in_difference(gate.kind, canary.n, canary.total, canary.total_sq,
                                                               stable.n, stable.total, stable.total_sq))
    if variance <= 0:
        flat = replace(base, outcome=_outcome(gate, p_run))
        return replace(flat, reason=f"{_describe(gate, flat)}; this look does not count (no spread in either arm)")
    sign = 1.0 if gate.direction == "max" else -1.0
    gain = sign * estimate
    if gate.role == "must_win":
        p_now = float(always_valid_p(gain, variance, gate.margin, gate.tau, "greater"))
    else:
        p_now = float(always_valid_p(gain, variance, -gate.margin, gate.tau, "less"))
    gain_low = float(confidence_bound(gain, variance, gate.tau, gate.alpha, "lower"))
    gain_high = float(confidence_bound(gain, variance, gate.tau, gate.alpha, "upper"))
    low_now, high_now = (gain_low, gain_high) if sign > 0 else (-gain_high, -gain_low)
    p = min(p_run, p_now)
    looked = replace(base, outcome=_outcome(gate, p), lower=max(low_run, low_now), upper=min(high_run, high_now), p=p)
    return replace(looked, reason=_describe(gate, looked))


def _outcome(gate: MetricGate, p: float) -> str:
    if p > gate.alpha:
        return "undecided"
    return "win" if gate.role == "must_win" else "lose"


@dataclass(frozen=True)
class EvidenceDecision:
    """The decision at one look: wait, promote or roll back, why, and every gate's verdict."""

    action: str  # wait | promote | rollback
    reason: str
    verdicts: tuple[MetricVerdict, ...]

    def figures(self) -> dict[str, Any]:
        return {"action": self.action, "reason": self.reason, "verdicts": [v.to_dict() for v in self.verdicts]}

    @classmethod
    def from_figures(cls, data: Mapping[str, Any]) -> EvidenceDecision:
        """The decision :meth:`figures` wrote (through JSON), to continue the next look from."""
        return cls(data["action"], data["reason"], tuple(MetricVerdict.from_dict(v) for v in data["verdicts"]))


def decide_on_evidence(policy: PromotionPolicy, canary: Mapping[str, ArmStats], stable: Mapping[str, ArmStats],
                       elapsed_s: float, previous: EvidenceDecision | None = None) -> EvidenceDecision:
    """Wait, promote or roll back (module docstring, The decision). ``canary`` and ``stable`` map
    each gate's metric to its cumulative observations since the canary began (a metric missing is
    no observations); ``previous`` is the last look's decision."""
    before = {(v.metric, v.role): v for v in previous.verdicts} if previous else {}
    empty = ArmStats(0, 0.0, 0.0)
    verdicts = tuple(judge_metric(g, canary.get(g.metric, empty), stable.get(g.metric, empty), policy.min_samples,
                                  before.get((g.metric, g.role))) for g in policy.gates)
    pairs = list(zip(policy.gates, verdicts))
    lost = [v for g, v in pairs if v.outcome == "lose"]
    wins = [v for g, v in pairs if g.role == "must_win"]
    open_wins = [v for v in wins if v.outcome != "win"]
    short = [v for v in verdicts if min(v.n_canary, v.n_stable) < policy.min_samples]
    clock = f"{elapsed_s:.0f}s of max window {policy.max_window_s:.0f}s"
    if lost:
        return EvidenceDecision("rollback", f"worse after {clock}: " + "; ".join(v.reason for v in lost), verdicts)
    if wins and not open_wins and not short:
        return EvidenceDecision("promote", f"evidence of a win after {clock}: "
                                           + "; ".join(v.reason for v in verdicts), verdicts)
    if elapsed_s >= policy.max_window_s:
        if wins and open_wins:
            return EvidenceDecision("rollback", f"no evidence of a win after {clock}: "
                                                + "; ".join(v.reason for v in open_wins), verdicts)
        if short:
            return EvidenceDecision("rollback", f"too few samples to judge after {clock}: "
                                                + "; ".join(v.reason for v in short), verdicts)
        return EvidenceDecision("promote", f"nothing worse after {clock}: "
                                           + "; ".join(v.reason for v in verdicts), verdicts)
    pending = open_wins or short or verdicts
    return EvidenceDecision("wait", f"waiting ({clock}): " + "; ".join(v.reason for v in pending), verdicts)
