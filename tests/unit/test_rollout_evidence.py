"""Promotion on evidence: the always-valid tests hold their error rates under continuous peeking.

Every simulation peeks after each batch of observations (20 per arm for rates; 20 canary and 60
stable for the float metric, so a 25% canary) from the 100th observation per arm on (min_samples),
up to N per canary arm, with fixed seeds, alpha = 0.05. The bound on a false rate is
alpha + 2 SE = 0.05 + 2 sqrt(0.05 * 0.95 / 10000) = 0.0544. Measured (``pytest -s`` prints them):

- rate p = 0.2 in both arms, N = 2000 per arm, 10,000 canaries: must_win false promotion (m = 0,
  tau = 0.05) 0.0221; must_not_lose false rollback (t = 0, tau = 0.05) 0.0208; a naive one-sided
  z-test at 0.05 peeked the same way: 0.265 and 0.264.
- rate 0.22 vs 0.20 (true effect = m = 0.02, H0's boundary, tau = m): false promotion 0.0083.
- rate 0.18 vs 0.20 with must_not_lose t = 0.02 (true effect = -t, its boundary): false rollback 0.0072.
- float, exponential latency (mean 1, skewed), direction min, N = 2000 canary / 6000 stable,
  10,000 canaries: must_win false promotion (m = 0, tau = 0.1) 0.0326, naive z peeked 0.294;
  canary mean 0.9 (true gain = m = 0.1, tau = m): 0.0348.
- power, 4,000 canaries each: rate 0.25 vs 0.20 with m = 0 (tau = 0.05) won within N = 2000 per
  arm in 0.896 (a fixed-sample test needs about 1200 per arm for 0.9); latency mean 0.8 vs 1.0 with
  m = 0.1 (true gain 2m, tau = m) within N = 1500 canary / 4500 stable in 0.926. Both asserted >= 0.8.

The mSPRT stays well under its alpha here (0.007-0.035): the price of validity at every look with
no horizon. The whole file runs in about 5 s (8 s with pytest's start-up) on two slow cores.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from serving.rollout_evidence import (
    ArmStats,
    EvidenceDecision,
    MetricGate,
    MetricVerdict,
    PromotionPolicy,
    always_valid_p,
    arm_variance,
    confidence_bound,
    decide_on_evidence,
    judge_metric,
    mixture_log_lr,
    plug_in_difference,
)

pytestmark = pytest.mark.unit

ALPHA = 0.05
SIMS = 10_000
#: The most a false rate may measure over 10,000 canaries: alpha plus two standard errors.
FALSE_RATE_BOUND = ALPHA + 2 * math.sqrt(ALPHA * (1 - ALPHA) / SIMS)
MIN_SAMPLES = 100
Z_05 = 1.6448536269514722  # the one-sided fixed-sample critical value at 0.05


def peek_rates(p_canary: float, p_stable: float, n_max: int, null: float, tau: float, alternative: str,
               sims: int = SIMS, batch: int = 20, seed: int = 0) -> tuple[float, float]:
    """Rates in both arms, looked at after every ``batch`` per arm: the share of canaries whose
    always-valid p-value reached alpha at some look, and the share a naive z-test (pooled, one-sided
    in the same direction) rejected at some look."""
    rng = np.random.default_rng(seed)
    looks = n_max // batch
    x_c = rng.binomial(batch, p_canary, size=(looks, sims)).cumsum(axis=0)
    x_s = rng.binomial(batch, p_stable, size=(looks, sims)).cumsum(axis=0)
    p_run, naive = np.ones(sims), np.zeros(sims, dtype=bool)
    sign = 1.0 if alternative == "greater" else -1.0
    for k in range(looks):
        n = (k + 1) * batch
        if n < MIN_SAMPLES:
            continue
        d, v = plug_in_difference("boolean", n, x_c[k], x_c[k], n, x_s[k], x_s[k])
        p_run = np.minimum(p_run, always_valid_p(d, v, null, tau, alternative))
        pooled = (x_c[k] + x_s[k]) / (2 * n)
        se = np.sqrt(pooled * (1 - pooled) * 2 / n)
        naive |= sign * (d - null) > Z_05 * np.where(se > 0, se, np.inf)
    return float((p_run <= ALPHA).mean()), float(naive.mean())


def peek_latency(mean_canary: float, mean_stable: float, n_max: int, margin: float, tau: float,
                 sims: int = SIMS, seed: int = 0) -> tuple[float, float]:
    """Exponential latencies (direction min), 20 canary and 60 stable per look, as in
    :func:`peek_rates`, must_win against gain <= ``margin``."""
    rng = np.random.default_rng(seed)
    sums = np.zeros((4, sims))
    p_run, naive = np.ones(sims), np.zeros(sims, dtype=bool)
    for k in range(n_max // 20):
        c = rng.exponential(mean_canary, size=(sims, 20))
        s = rng.exponential(mean_stable, size=(sims, 60))
        sums += [c.sum(axis=1), (c * c).sum(axis=1), s.sum(axis=1), (s * s).sum(axis=1)]
        n_c, n_s = (k + 1) * 20, (k + 1) * 60
        if n_c < MIN_SAMPLES:
            continue
        d, v = plug_in_difference("float", n_c, sums[0], sums[1], n_s, sums[2], sums[3])
        gain = -d  # smaller is better
        p_run = np.minimum(p_run, always_valid_p(gain, v, margin, tau, "greater"))
        naive |= gain - margin > Z_05 * np.sqrt(v)
    return float((p_run <= ALPHA).mean()), float(naive.mean())


# --- the sequential test's maths -------------------------------------------------------------------


def test_mixture_closed_form_matches_quadrature() -> None:
    rng = np.random.default_rng(7)
    for w, r in zip(rng.uniform(0, 4, 6), np.exp(rng.uniform(-3, 5, 6))):
        tau = math.sqrt(r)  # V = 1
        delta = np.linspace(0, 40 * tau, 200_001)
        density = 2 / (math.sqrt(2 * math.pi) * tau) * np.exp(-delta**2 / (2 * tau**2) + delta * w - delta**2 / 2)
        assert float(mixture_log_lr(w, r)) == pytest.approx(math.log(np.trapezoid(density, delta)), abs=1e-6)


def test_plug_in_difference_by_hand() -> None:
    # rates 30/100 vs 20/100: Laplace-smoothed p = 31/102 and 21/102
    d, v = plug_in_difference("boolean", 100, 30, 30, 100, 20, 20)
    pc, ps = 31 / 102, 21 / 102
    assert float(d) == pytest.approx(0.10)
    assert float(v) == pytest.approx(pc * (1 - pc) / 100 + ps * (1 - ps) / 100)
    # means of [1, 2, 3, 4] vs [2, 2, 5]: sample variances 5/3 and 3
    c, s = ArmStats.from_values([1, 2, 3, 4]), ArmStats.from_values([2, 2, 5])
    d, v = plug_in_difference("float", c.n, c.total, c.total_sq, s.n, s.total, s.total_sq)
    assert float(d) == pytest.approx(2.5 - 3.0)
    assert float(v) == pytest.approx((5 / 3) / 4 + 3 / 3)
    assert float(arm_variance("float", 1, 5.0, 25.0)) == 0.0
    with pytest.raises(ValueError, match="kind"):
        arm_variance("count", 3, 1, 1)


def test_bound_and_p_value_are_the_same_test() -> None:
    rng = np.random.default_rng(11)
    est, var, tau = rng.normal(0, 0.05, 200), rng.uniform(1e-5, 1e-2, 200), rng.uniform(0.005, 0.2, 200)
    low = confidence_bound(est, var, tau, ALPHA, "lower")
    high = confidence_bound(est, var, tau, ALPHA, "upper")
    assert np.all(low < est) and np.all(est < high)
    np.testing.assert_allclose(est - low, high - est, rtol=1e-9)
    # the null at the bound is rejected at exactly alpha, from either side
    np.testing.assert_allclose(always_valid_p(est, var, low, tau, "greater"), ALPHA, rtol=1e-6)
    np.testing.assert_allclose(always_valid_p(est, var, high, tau, "less"), ALPHA, rtol=1e-6)
    # a scalar look agrees with the vector one
    assert float(confidence_bound(est[3], var[3], tau[3], ALPHA)) == pytest.approx(low[3], rel=1e-12)
    # wider than the fixed-sample bound: the price of looking at every tick
    assert np.all(est - low > Z_05 * np.sqrt(var))


def test_p_value_is_one_without_evidence() -> None:
    assert float(always_valid_p(-0.1, 0.01, 0.0, 0.05)) == 1.0  # estimate on the null's side
    assert float(always_valid_p(0.0, 0.01, 0.0, 0.05)) == 1.0
    assert float(always_valid_p(0.3, 0.0, 0.0, 0.05)) == 1.0  # no variance: no evidence
    assert float(confidence_bound(0.3, 0.0, 0.05, ALPHA)) == -math.inf
    assert float(always_valid_p(0.3, 1e-4, 0.0, 0.05)) < 1e-12  # no overflow far out
    with pytest.raises(ValueError, match="alternative"):
        always_valid_p(0.1, 0.01, 0.0, 0.05, "two-sided")
    with pytest.raises(ValueError, match="alpha"):
        confidence_bound(0.1, 0.01, 0.05, 0.5)


# --- error rates and power under continuous peeking ------------------------------------------------


def test_rate_false_promotion_stays_within_alpha_while_naive_peeking_does_not() -> None:
    false_win, naive = peek_rates(0.2, 0.2, 2000, null=0.0, tau=0.05, alternative="greater", seed=1)
    print(f"\nrate 0.2 vs 0.2, must_win m=0, N=2000/arm: false promotion {false_win:.4f} "
          f"(bound {FALSE_RATE_BOUND:.4f}); naive z peeked {naive:.4f}")
    assert false_win <= FALSE_RATE_BOUND
    assert naive > FALSE_RATE_BOUND  # peeking at a fixed-sample test is what this module exists for


def test_rate_false_rollback_of_must_not_lose_stays_within_alpha() -> None:
    false_loss, naive = peek_rates(0.2, 0.2, 2000, null=0.0, tau=0.05, alternative="less", seed=2)
    print(f"\nrate 0.2 vs 0.2, must_not_lose t=0: false rollback {false_loss:.4f}; naive z peeked {naive:.4f}")
    assert false_loss <= FALSE_RATE_BOUND
    at_tolerance, _ = peek_rates(0.18, 0.2, 2000, null=-0.02, tau=0.02, alternative="less", seed=3)
    print(f"rate 0.18 vs 0.2, must_not_lose t=0.02 (at its boundary): false rollback {at_tolerance:.4f}")
    assert at_tolerance <= FALSE_RATE_BOUND


def test_rate_false_promotion_at_the_minimum_effect() -> None:
    false_win, _ = peek_rates(0.22, 0.2, 2000, null=0.02, tau=0.02, alternative="greater", seed=4)
    print(f"\nrate 0.22 vs 0.2, must_win m=0.02 (true effect = m): false promotion {false_win:.4f}")
    assert false_win <= FALSE_RATE_BOUND


def test_rate_power() -> None:
    power, _ = peek_rates(0.25, 0.2, 2000, null=0.0, tau=0.05, alternative="greater", sims=4000, seed=5)
    print(f"\nrate 0.25 vs 0.2, must_win m=0, N=2000/arm: power {power:.4f}")
    assert power >= 0.8


def test_float_false_promotion_stays_within_alpha_with_skewed_data_and_uneven_arms() -> None:
    false_win, naive = peek_latency(1.0, 1.0, 2000, margin=0.0, tau=0.1, seed=6)
    print(f"\nlatency exp(1) both arms, min, must_win m=0, N=2000/6000: false promotion {false_win:.4f}; "
          f"naive z peeked {naive:.4f}")
    assert false_win <= FALSE_RATE_BOUND
    assert naive > FALSE_RATE_BOUND
    at_margin, _ = peek_latency(0.9, 1.0, 2000, margin=0.1, tau=0.1, seed=7)
    print(f"latency 0.9 vs 1.0, must_win m=0.1 (true gain = m): false promotion {at_margin:.4f}")
    assert at_margin <= FALSE_RATE_BOUND


def test_float_power_for_twice_the_minimum_effect() -> None:
    power, _ = peek_latency(0.8, 1.0, 1500, margin=0.1, tau=0.1, sims=4000, seed=8)
    print(f"\nlatency 0.8 vs 1.0, must_win m=0.1 (true gain 2m), N=1500/4500: power {power:.4f}")
    assert power >= 0.8


# --- gate verdicts ---------------------------------------------------------------------------------


def win_gate(**kw: object) -> MetricGate:
    fields = {"metric": "accepted", "kind": "boolean", "direction": "max", "role": "must_win", "margin": 0.0,
              "mixing_sd": 0.05} | kw
    return MetricGate(**fields)  # type: ignore[arg-type]


def test_verdict_carries_estimate_interval_p_and_counts() -> None:
    v = judge_metric(win_gate(), ArmStats.from_counts(500, 2000), ArmStats.from_counts(400, 2000), MIN_SAMPLES)
    assert v.outcome == "win"
    assert (v.n_canary, v.n_stable) == (2000, 2000)
    assert v.effect == pytest.approx(0.05)
    assert 0 < v.lower < v.effect < v.upper
    assert v.p < ALPHA
    d, var = plug_in_difference("boolean", 2000, 500, 500, 2000, 400, 400)
    assert v.p == pytest.approx(float(always_valid_p(d, var, 0.0, 0.05)))
    assert "accepted must_win" in v.reason and "p=" in v.reason and "win" in v.reason and "[+0.01" in v.reason


def test_verdict_is_running_p_never_rises_and_interval_only_narrows() -> None:
    rng = np.random.default_rng(12)
    gate, previous, c, s = win_gate(), None, ArmStats(0, 0.0, 0.0), ArmStats(0, 0.0, 0.0)
    history = []
    for _ in range(40):
        c = c + ArmStats.from_counts(int(rng.binomial(50, 0.2)), 50)
        s = s + ArmStats.from_counts(int(rng.binomial(50, 0.2)), 50)
        previous = judge_metric(gate, c, s, MIN_SAMPLES, previous)
        history.append(previous)
    assert all(b.p <= a.p for a, b in zip(history, history[1:]))
    assert all(b.lower >= a.lower and b.upper <= a.upper for a, b in zip(history, history[1:]))
    assert history[0].p == 1.0 and "does not count" in history[0].reason  # 50 < min_samples
    with pytest.raises(ValueError, match="previous verdict"):
        judge_metric(win_gate(metric="other"), c, s, MIN_SAMPLES, previous)


def test_direction_min_is_mirrored_and_reported_in_the_metric_units() -> None:
    gate = MetricGate("latency_ms", "float", "min", "must_win", margin=10.0)
    rng = np.random.default_rng(13)
    c = ArmStats.from_values(rng.normal(400, 50, 3000))
    s = ArmStats.from_values(rng.normal(450, 50, 3000))
    v = judge_metric(gate, c, s, MIN_SAMPLES)
    assert v.outcome == "win" and v.lower < v.effect < v.upper < -10.0  # faster by more than 10 ms
    assert "effect >= -10" in v.reason
    slower = judge_metric(gate, s, c, MIN_SAMPLES)
    assert slower.outcome == "undecided" and slower.upper > slower.effect > 10.0
    # the same data as a max-metric of the negated values gives the mirrored verdict
    neg = MetricGate("speed", "float", "max", "must_win", margin=10.0)
    m = judge_metric(neg, ArmStats(c.n, -c.total, c.total_sq), ArmStats(s.n, -s.total, s.total_sq), MIN_SAMPLES)
    assert m.p == pytest.approx(v.p) and (m.lower, m.upper) == pytest.approx((-v.upper, -v.lower))


def test_must_not_lose_loses_only_beyond_its_tolerance() -> None:
    gate = MetricGate("success", "boolean", "max", "must_not_lose", margin=0.02)
    a_bit_worse = judge_metric(gate, ArmStats.from_counts(390, 2000), ArmStats.from_counts(400, 2000), MIN_SAMPLES)
    assert a_bit_worse.outcome == "undecided"
    much_worse = judge_metric(gate, ArmStats.from_counts(250, 2000), ArmStats.from_counts(400, 2000), MIN_SAMPLES)
    assert much_worse.outcome == "lose" and much_worse.upper < -0.02
    assert "effect >= -0.02" in much_worse.reason


def test_edge_cases_zero_variance_tiny_samples_all_ones() -> None:
    flat = MetricGate("edits_kept", "float", "max", "must_win", margin=0.5)
    same = judge_metric(flat, ArmStats.from_values([3.0] * 500), ArmStats.from_values([3.0] * 500), MIN_SAMPLES)
    apart = judge_metric(flat, ArmStats.from_values([4.0] * 500), ArmStats.from_values([3.0] * 500), MIN_SAMPLES)
    for v in (same, apart):
        assert v.outcome == "undecided" and v.p == 1.0 and "no spread" in v.reason
    assert apart.effect == 1.0 and (apart.lower, apart.upper) == (-math.inf, math.inf)

    tiny = judge_metric(win_gate(), ArmStats.from_counts(5, 5), ArmStats.from_counts(0, 5), MIN_SAMPLES)
    assert tiny.outcome == "undecided" and tiny.p == 1.0 and "fewer than min_samples 100" in tiny.reason
    none = judge_metric(win_gate(), ArmStats(0, 0.0, 0.0), ArmStats(0, 0.0, 0.0), MIN_SAMPLES)
    assert math.isnan(none.effect) and "canary n=0" in none.reason

    ones = judge_metric(win_gate(), ArmStats.from_counts(800, 800), ArmStats.from_counts(800, 800), MIN_SAMPLES)
    assert ones.outcome == "undecided" and ones.effect == 0.0 and ones.p == 1.0 and ones.lower < 0 < ones.upper
    better = judge_metric(win_gate(), ArmStats.from_counts(800, 800), ArmStats.from_counts(160, 800), MIN_SAMPLES)
    assert better.outcome == "win" and better.lower > 0.7


def test_gate_and_policy_validation() -> None:
    with pytest.raises(ValueError, match="no scale"):
        MetricGate("a", "boolean", "max", "must_win", margin=0.0)
    assert MetricGate("a", "boolean", "max", "must_win", margin=0.03).tau == 0.03
    for bad in ({"kind": "count"}, {"direction": "up"}, {"role": "should_win"}, {"margin": -0.1},
                {"margin": 1.0}, {"alpha": 0.5}, {"mixing_sd": 0.0}):
        with pytest.raises(ValueError):
            win_gate(**bad)
    with pytest.raises(ValueError, match="repeat"):
        PromotionPolicy((win_gate(), win_gate()), max_window_s=60)
    with pytest.raises(ValueError, match="at least one"):
        PromotionPolicy((), max_window_s=60)
    with pytest.raises(ValueError, match="min_samples"):
        PromotionPolicy((win_gate(),), max_window_s=60, min_samples=1)


def test_verdict_round_trips_through_json() -> None:
    v = judge_metric(win_gate(), ArmStats.from_counts(5, 5), ArmStats.from_counts(0, 5), MIN_SAMPLES)
    text = json.dumps(v.to_dict(), allow_nan=False)
    assert MetricVerdict.from_dict(json.loads(text)) == v


# --- the decision ----------------------------------------------------------------------------------

POLICY = PromotionPolicy(
    gates=(win_gate(),
           MetricGate("latency_ms", "float", "min", "must_not_lose", margin=20.0)),
    max_window_s=3600, min_samples=200)


def run_canary(accept_c: float, latency_c: float, seed: int, looks: int = 40) -> list[EvidenceDecision]:
    """A canary against stable (accept 0.2, latency N(400, 60)), 100 generations per arm every 120 s,
    until the decision is no longer wait."""
    rng = np.random.default_rng(seed)
    arms = {"c": {"accepted": ArmStats(0, 0.0, 0.0), "latency_ms": ArmStats(0, 0.0, 0.0)},
            "s": {"accepted": ArmStats(0, 0.0, 0.0), "latency_ms": ArmStats(0, 0.0, 0.0)}}
    decisions: list[EvidenceDecision] = []
    for k in range(1, looks + 1):
        for arm, accept, latency in (("c", accept_c, latency_c), ("s", 0.2, 400.0)):
            arms[arm]["accepted"] += ArmStats.from_counts(int(rng.binomial(100, accept)), 100)
            arms[arm]["latency_ms"] += ArmStats.from_values(rng.normal(latency, 60.0, 100))
        decisions.append(decide_on_evidence(POLICY, arms["c"], arms["s"], 120.0 * k,
                                            decisions[-1] if decisions else None))
        if decisions[-1].action != "wait":
            break
    return decisions


def test_decision_promotes_a_winner_before_the_window() -> None:
    decisions = run_canary(0.27, 405.0, seed=21)
    last = decisions[-1]
    print(f"\nwinner: {last.action} after {len(decisions)} looks: {last.reason}")
    assert last.action == "promote" and len(decisions) * 120 < POLICY.max_window_s
    assert "evidence of a win" in last.reason and "accepted must_win" in last.reason
    assert decisions[0].action == "wait" and "fewer than min_samples" in decisions[0].reason
    assert json.dumps(last.figures(), allow_nan=False)


def test_decision_rolls_back_a_worse_canary_at_once() -> None:
    decisions = run_canary(0.3, 470.0, seed=22)
    last = decisions[-1]
    print(f"\nslower: {last.action} after {len(decisions)} looks: {last.reason}")
    assert last.action == "rollback" and last.reason.startswith("worse")
    assert "latency_ms must_not_lose" in last.reason and "lose" in last.reason


def test_decision_gives_up_after_the_window_without_a_win() -> None:
    decisions = run_canary(0.2, 400.0, seed=23)
    last = decisions[-1]
    print(f"\nequal: {last.action} after {len(decisions)} looks: {last.reason}")
    assert [d.action for d in decisions[:-1]] == ["wait"] * (len(decisions) - 1)
    assert last.action == "rollback" and last.reason.startswith("no evidence of a win after 3600s")
    assert "accepted must_win" in last.reason and "undecided" in last.reason


def test_decision_without_must_win_promotes_when_the_window_closes_with_nothing_lost() -> None:
    policy = PromotionPolicy((MetricGate("latency_ms", "float", "min", "must_not_lose", margin=20.0),),
                             max_window_s=600)
    c = {"latency_ms": ArmStats.from_values(np.full(200, 400.0) + np.arange(200) % 7)}
    s = {"latency_ms": ArmStats.from_values(np.full(200, 401.0) + np.arange(200) % 5)}
    assert decide_on_evidence(policy, c, s, 300).action == "wait"
    assert decide_on_evidence(policy, c, s, 600).action == "promote"
    short = decide_on_evidence(policy, {}, s, 600)  # the canary never reported the metric
    assert short.action == "rollback" and short.reason.startswith("too few samples")
