"""The rollout controller's policy, pure: the statistics, the gates and the canary verdict as
functions of plain numbers, and the versions a failed load implicates (``serving.rollout`` reads the
registry and the database, applies them, and documents the tests, their reading and the rule).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from flywheel.settings import RolloutSettings

#: A gate says whether a candidate may be promoted (True) given all versions (see :func:`decide`).
Gate = Callable[[Any, Sequence[Any]], bool]
#: Feedback signals that count as negative (thumbs counts when its value is below 0).
NEGATIVE_SIGNALS = ("edit_rejected", "retry", "abandon")
#: Latencies read per version for the latency test (the newest ones).
LATENCY_SAMPLE_CAP = 20_000

# --- statistics (pure) -----------------------------------------------------------------------------


def normal_sf(z: float) -> float:
    """P(Z > z) for a standard normal Z."""
    return 0.5 * math.erfc(z / math.sqrt(2.0))


@dataclass(frozen=True)
class StatTest:
    statistic: float  # z
    p: float  # one-sided: the canary is worse


def two_proportion_test(x_canary: int, n_canary: int, x_stable: int, n_stable: int) -> StatTest:
    """One-sided two-proportion z-test of H1: the canary's rate is above stable's.

    z = (p_c - p_s) / sqrt(p (1 - p) (1/n_c + 1/n_s)) with the pooled p = (x_c + x_s) / (n_c + n_s);
    p-value P(Z > z). With no variance (no events at all, or all events) z = 0, p = 0.5.
    """
    if n_canary <= 0 or n_stable <= 0:
        raise ValueError("both samples need at least one observation")
    if not (0 <= x_canary <= n_canary and 0 <= x_stable <= n_stable):
        raise ValueError("event counts must lie between 0 and their sample sizes")
    pooled = (x_canary + x_stable) / (n_canary + n_stable)
    se = math.sqrt(pooled * (1 - pooled) * (1 / n_canary + 1 / n_stable))
    z = 0.0 if se == 0 else (x_canary / n_canary - x_stable / n_stable) / se
    return StatTest(z, normal_sf(z))


def mann_whitney_greater(xs: Sequence[float], ys: Sequence[float]) -> StatTest:
    """One-sided Mann-Whitney U test of H1: ``xs`` tend to be larger than ``ys``.

    U = R_x - n_x (n_x + 1) / 2 with R_x the sum of the ranks of ``xs`` in the pooled sample (ties
    get their average rank); normal approximation with mean n_x n_y / 2, variance
    n_x n_y / 12 * ((N + 1) - sum(t^3 - t) / (N (N - 1))) over tie groups of size t, and a
    continuity correction of 0.5: z = (U - mean - 0.5) / sd. All values tied: z = 0, p = 0.5.
    """
    x, y = np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)
    nx, ny = len(x), len(y)
    if nx == 0 or ny == 0:
        raise ValueError("both samples need at least one observation")
    pooled = np.concatenate([x, y])
    values, inverse, counts = np.unique(pooled, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    ranks = (ends - (counts - 1) / 2.0)[inverse]  # average rank of each tie group, 1-based
    u = float(ranks[:nx].sum()) - nx * (nx + 1) / 2.0
    n = nx + ny
    ties = float((counts.astype(np.float64) ** 3 - counts).sum())
    variance = nx * ny / 12.0 * ((n + 1) - ties / (n * (n - 1))) if n > 1 else 0.0
    if variance <= 0:
        return StatTest(0.0, 0.5)
    z = (u - nx * ny / 2.0 - 0.5) / math.sqrt(variance)
    return StatTest(z, normal_sf(z))


# --- canary evidence and verdict (pure) ------------------------------------------------------------


@dataclass(frozen=True)
class VersionSample:
    """What one version served in the canary window."""

    generations: int
    negative: int  # generations with at least one negative feedback event
    errors: int  # generations with finish_reason "error"
    latencies_ms: tuple[float, ...] = ()

    def figures(self) -> dict[str, Any]:
        return {"generations": self.generations, "negative": self.negative, "errors": self.errors,
                "latency_median_ms": float(np.median(self.latencies_ms)) if self.latencies_ms else None,
                "latency_n": len(self.latencies_ms)}


@dataclass(frozen=True)
class Verdict:
    action: str  # wait | promote | rollback
    reason: str
    figures: dict[str, Any] = field(default_factory=dict)


def judge_canary(canary: VersionSample, stable: VersionSample, elapsed_s: float, policy: RolloutSettings) -> Verdict:
    """Wait, promote or roll back a canary (module docstring, step 2)."""
    figures: dict[str, Any] = {"elapsed_s": round(elapsed_s, 1), "canary": canary.figures(), "stable": stable.figures()}
    if canary.generations == 0 and stable.generations >= policy.min_samples and elapsed_s >= policy.window_s:
        return Verdict("rollback", f"canary served nothing in {elapsed_s:.0f}s while stable served "
                                   f"{stable.generations}: no node serves it (the nodes table says failed_update "
                                   "and why)", figures)
    if canary.generations < policy.min_samples or stable.generations < policy.min_samples:
        return Verdict("wait", f"samples canary {canary.generations}, stable {stable.generations} "
                               f"< min_samples {policy.min_samples}", figures)
    neg = two_proportion_test(canary.negative, canary.generations, stable.negative, stable.generations)
    err = two_proportion_test(canary.errors, canary.generations, stable.errors, stable.generations)
    parts = [f"neg {canary.negative}/{canary.generations} vs {stable.negative}/{stable.generations} p={neg.p:.3g}",
             f"err {canary.errors}/{canary.generations} vs {stable.errors}/{stable.generations} p={err.p:.3g}"]
    figures["tests"] = {"negative": asdict(neg), "errors": asdict(err)}
    worse = [name for name, t in (("negative feedback", neg), ("errors", err)) if t.p < policy.alpha]
    if canary.latencies_ms and stable.latencies_ms:
        scaled = [v * (1 + policy.latency_tolerance) for v in stable.latencies_ms]
        lat = mann_whitney_greater(canary.latencies_ms, scaled)
        figures["tests"]["latency"] = asdict(lat)
        parts.append(f"latency median {np.median(canary.latencies_ms):.0f} vs {np.median(stable.latencies_ms):.0f} ms "
                     f"(+{policy.latency_tolerance:.0%} allowed) p={lat.p:.3g}")
        if lat.p < policy.alpha:
            worse.append("latency")
    else:
        parts.append("latency: no samples")
    summary = "; ".join(parts)
    if worse:
        return Verdict("rollback", f"worse {', '.join(worse)} at alpha {policy.alpha}: {summary}", figures)
    if elapsed_s < policy.window_s:
        return Verdict("wait", f"window {elapsed_s:.0f}/{policy.window_s:.0f}s; {summary}", figures)
    return Verdict("promote", f"not worse over {elapsed_s:.0f}s: {summary}", figures)


# --- gates (pure) ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class GateResult:
    ok: bool
    reason: str


@dataclass(frozen=True)
class HeldOutRow:
    """One ``reward_version_stats`` row, reduced to what the held-out gate reads."""

    spec_version: str
    version: int
    count: int
    total: float  # sum of total rewards
    flagged: bool = False
    flag_reason: str = ""

    @property
    def rate(self) -> float:
        return self.total / self.count


def held_out_gate(rows: Sequence[HeldOutRow], candidate: int, stable: int | None,
                  policy: RolloutSettings) -> GateResult:
    """The held-out reward gate; ``rows`` are ordered newest spec version first."""
    specs = list(dict.fromkeys(r.spec_version for r in rows))
    by_key = {(r.spec_version, r.version): r for r in rows}
    mine = [by_key[(s, candidate)] for s in specs if (s, candidate) in by_key]
    if mine and mine[0].flagged:
        return GateResult(False, f"held-out: flagged by the reward guard (spec {mine[0].spec_version}): "
                                 f"{mine[0].flag_reason}")
    if stable is None:
        return GateResult(True, "held-out: no stable version to compare with")
    need = policy.held_out_min_samples
    for spec in specs:
        c, s = by_key.get((spec, candidate)), by_key.get((spec, stable))
        if c is None or s is None or c.count < need or s.count < need:
            continue
        figures = f"v{candidate} {c.rate:.4f} (n={c.count}) vs v{stable} {s.rate:.4f} (n={s.count}), spec {spec}"
        if c.rate < s.rate - policy.held_out_tolerance:
            return GateResult(False, f"held-out: rate below stable by more than {policy.held_out_tolerance}: {figures}")
        return GateResult(True, f"held-out: {figures}")
    c_n = mine[0].count if mine else 0
    s_n = next((by_key[(spec, stable)].count for spec in specs if (spec, stable) in by_key), 0)
    return GateResult(True, f"held-out: too few samples to compare (v{candidate} n={c_n}, v{stable} n={s_n}, "
                            f"need {need}); passes")


def parity_gate(metrics: dict[str, Any], policy: RolloutSettings) -> GateResult:
    """The trainer/inference numerical parity gate over a version's metrics."""
    value = metrics.get(policy.parity_metric)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return GateResult(True, f"parity: no {policy.parity_metric!r} figure")
    if not math.isfinite(value) or value >= policy.parity_max:
        return GateResult(False, f"parity: {policy.parity_metric}={value:.4g} >= {policy.parity_max}")
    return GateResult(True, f"parity: {policy.parity_metric}={value:.4g} < {policy.parity_max}")


def _candidates(versions: Sequence[Any]) -> list[Any]:
    """Candidates newer than the newest stable version, newest first."""
    floor = max((v.version for v in versions if v.status == "stable"), default=-1)
    return sorted((v for v in versions if v.status == "candidate" and v.version > floor),
                  key=lambda v: v.version, reverse=True)


def decide(versions: Sequence[Any], gates: Sequence[Gate] = ()) -> int | None:
    """The newest candidate newer than stable (any candidate when nothing is stable) that every
    boolean gate passes, or None. ``versions`` have ``version`` and ``status``."""
    for candidate in _candidates(versions):
        if all(gate(candidate, versions) for gate in gates):
            return candidate.version
    return None


def choose_candidate(versions: Sequence[Any], gate: Callable[[Any], list[GateResult]]
                     ) -> tuple[int | None, dict[int, list[GateResult]]]:
    """Like :func:`decide` with gates that explain themselves: the chosen version (or None) and
    the gate results of every candidate looked at."""
    seen: dict[int, list[GateResult]] = {}
    for candidate in _candidates(versions):
        results = seen[candidate.version] = gate(candidate)
        if all(r.ok for r in results):
            return candidate.version, seen
    return None, seen


#: The statuses a failed load moves to ``rolled_back`` when it implicates them (:func:`implicated`).
IMPLICABLE = ("candidate", "retired")


def implicated(versions: Sequence[Any], version: int, floor: int | None) -> list[int]:
    """The versions a failed load of ``version`` implicates, newest first: those on its chain
    (parent links of its deltas) newer than ``floor``, the last version known good (the stable
    version a canary was compared with, or the one the fleet still serves after a stable version
    failed), that are ``candidate`` or ``retired`` (stable on paper only: the fleet is on ``floor``,
    below it). Without a floor the walk stops at a version that is or was stable. ``version``
    itself is not in it; versions with another status (an earlier rollback) are walked past.
    ``versions`` have ``version``, ``status``, ``kind`` and ``parent``."""
    by_number = {v.version: v for v in versions}
    found: list[int] = []
    current = by_number.get(version)
    while current is not None and current.kind == "delta" and current.parent is not None:
        if current.parent >= current.version:  # not a chain (the registry refuses to load it anyway)
            break
        current = by_number.get(current.parent)
        if current is None or (current.version <= floor if floor is not None
                               else current.status in ("stable", "retired")):
            break
        if current.status in IMPLICABLE:
            found.append(current.version)
    return found


def restore_after_failed_load(versions: Sequence[Any], transitions: Sequence[dict[str, Any]], failed: int,
                              serving: int | None) -> int | None:
    """The version a rollback of stable ``failed`` restores when no node could load it: the one
    every fresh node still serves (``serving``: known good, and what the fleet never left), unless
    that is ``failed`` itself, unknown, rolled back or collected; otherwise :func:`previous_stable`.
    (Two promotions before the nodes report make the previous stable version one no node ever
    loaded, and whose chain may hold the same damaged object.)"""
    by_number = {v.version: v for v in versions}
    if (serving is not None and serving != failed and serving in by_number
            and by_number[serving].status not in ("rolled_back", "collected")):
        return serving
    return previous_stable(versions, transitions, failed)


def previous_stable(versions: Sequence[Any], transitions: Sequence[dict[str, Any]], current: int) -> int | None:
    """The version a rollback of stable ``current`` restores: the newest version other than
    ``current`` that was ever stable and is neither rolled back nor collected."""
    was_stable = {t["version"] for t in transitions if t["to_status"] == "stable"}
    usable = [v.version for v in versions if v.version in was_stable and v.version != current
              and v.status not in ("rolled_back", "collected")]
    return max(usable, default=None)
