"""The rollout controller's pure parts: the tests it runs, the canary verdict, the gates, rollback."""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass

import pytest

from flywheel.settings import RolloutSettings
from serving.rollout_policy import (
    GateResult,
    HeldOutRow,
    VersionSample,
    choose_candidate,
    held_out_gate,
    judge_canary,
    mann_whitney_greater,
    normal_sf,
    parity_gate,
    previous_stable,
    two_proportion_test,
)

pytestmark = pytest.mark.unit


@dataclass(frozen=True)
class V:
    version: int
    status: str
    metrics: dict | None = None


def test_normal_tail_matches_the_table():
    assert normal_sf(0.0) == pytest.approx(0.5)
    assert normal_sf(1.6448536) == pytest.approx(0.05, abs=1e-7)
    assert normal_sf(1.959964) == pytest.approx(0.025, abs=1e-7)
    assert normal_sf(-1.959964) == pytest.approx(0.975, abs=1e-7)


def test_two_proportion_z_by_hand():
    """canary 30/200 = 0.15, stable 15/200 = 0.075; pooled p = 45/400 = 0.1125;
    se = sqrt(0.1125 * 0.8875 * (1/200 + 1/200)) = sqrt(0.000998437) = 0.0315981;
    z = 0.075 / 0.0315981 = 2.37356; one-sided p = P(Z > 2.37356) = 0.00881."""
    t = two_proportion_test(30, 200, 15, 200)
    assert t.statistic == pytest.approx(2.37356, abs=1e-5)
    assert t.p == pytest.approx(0.00881, abs=1e-5)
    # The other way round the canary is better: z = -2.37356, p = 0.99119.
    better = two_proportion_test(15, 200, 30, 200)
    assert better.statistic == pytest.approx(-2.37356, abs=1e-5) and better.p == pytest.approx(0.99119, abs=1e-5)


def test_two_proportion_without_variance_is_no_evidence():
    assert two_proportion_test(0, 50, 0, 80).p == 0.5
    assert two_proportion_test(50, 50, 80, 80).p == 0.5
    with pytest.raises(ValueError):
        two_proportion_test(0, 0, 1, 10)
    with pytest.raises(ValueError):
        two_proportion_test(11, 10, 1, 10)


def test_mann_whitney_by_hand_without_ties():
    """xs = 5 6 7 above ys = 1 2 3 4: ranks of xs 5+6+7 = 18, U = 18 - 3*4/2 = 12 (= nx*ny);
    mean 3*4/2 = 6, variance 3*4/12 * (7 + 1) = 8; z = (12 - 6 - 0.5) / sqrt(8) = 1.94454;
    p = P(Z > 1.94454) = 0.02591."""
    t = mann_whitney_greater([7, 5, 6], [4, 1, 3, 2])
    assert t.statistic == pytest.approx(1.94454, abs=1e-5)
    assert t.p == pytest.approx(0.02591, abs=1e-5)


def test_mann_whitney_by_hand_with_ties():
    """xs = 2 3 3, ys = 1 2 3. Pooled ranks: 1 -> 1, the two 2s -> 2.5, the three 3s -> 5.
    R_x = 2.5 + 5 + 5 = 12.5, U = 12.5 - 6 = 6.5, mean 4.5; ties t = 1, 2, 3: sum(t^3 - t) = 30;
    variance 9/12 * (7 - 30 / (6*5)) = 4.5; z = (6.5 - 4.5 - 0.5) / sqrt(4.5) = 0.70711; p = 0.23975."""
    t = mann_whitney_greater([2, 3, 3], [1, 2, 3])
    assert t.statistic == pytest.approx(0.70711, abs=1e-5)
    assert t.p == pytest.approx(0.23975, abs=1e-5)
    assert mann_whitney_greater([4, 4], [4, 4, 4]).p == 0.5  # all tied: no evidence


def test_mann_whitney_u_equals_the_pair_count_on_random_samples():
    """U from rank sums equals the number of pairs with x > y (ties count one half)."""
    rng = random.Random()
    for _ in range(100):
        xs = [rng.randint(0, 20) for _ in range(rng.randint(1, 30))]
        ys = [rng.randint(0, 20) for _ in range(rng.randint(1, 30))]
        nx, ny, n = len(xs), len(ys), len(xs) + len(ys)
        u = sum((x > y) + 0.5 * (x == y) for x in xs for y in ys)
        ties = sum(t**3 - t for t in Counter(xs + ys).values())
        variance = nx * ny / 12 * ((n + 1) - ties / (n * (n - 1))) if n > 1 else 0.0
        t = mann_whitney_greater(xs, ys)
        if variance <= 0:
            assert (t.statistic, t.p) == (0.0, 0.5)
        else:
            assert t.statistic == pytest.approx((u - nx * ny / 2 - 0.5) / math.sqrt(variance))
            assert t.p == pytest.approx(normal_sf(t.statistic))


POLICY = RolloutSettings(min_samples=100, window_s=60, alpha=0.05, latency_tolerance=0.1)


def sample(n: int, negative: int = 0, errors: int = 0, latency: float = 100.0) -> VersionSample:
    return VersionSample(n, negative, errors, tuple(latency + (i % 7) for i in range(n)))


def test_canary_waits_below_min_samples():
    v = judge_canary(sample(99, negative=50), sample(1000), elapsed_s=1e6, policy=POLICY)
    assert v.action == "wait" and "min_samples 100" in v.reason
    assert judge_canary(sample(500), sample(99), elapsed_s=1e6, policy=POLICY).action == "wait"


def test_equal_canary_waits_for_the_window_then_promotes():
    canary, stable = sample(200, negative=10, errors=1), sample(2000, negative=100, errors=10)
    assert judge_canary(canary, stable, elapsed_s=30, policy=POLICY).action == "wait"
    v = judge_canary(canary, stable, elapsed_s=61, policy=POLICY)
    assert v.action == "promote"
    assert v.figures["canary"]["negative"] == 10 and v.figures["stable"]["generations"] == 2000
    assert v.figures["tests"]["negative"]["p"] == pytest.approx(0.5)


def test_more_thumbs_down_rolls_back_even_inside_the_window():
    # 30/200 vs 15/200: p = 0.0088 (hand-computed above) < 0.05.
    v = judge_canary(sample(200, negative=30), sample(200, negative=15), elapsed_s=1, policy=POLICY)
    assert v.action == "rollback" and "negative feedback" in v.reason
    # At alpha 0.005 the same figures are not significant.
    strict = POLICY.model_copy(update={"alpha": 0.005})
    v = judge_canary(sample(200, negative=30), sample(200, negative=15), elapsed_s=61, policy=strict)
    assert v.action == "promote"


def test_more_errors_roll_back():
    v = judge_canary(sample(300, errors=20), sample(3000, errors=30), elapsed_s=61, policy=POLICY)
    assert v.action == "rollback" and "errors" in v.reason


def test_latency_within_the_tolerance_is_not_worse_and_beyond_it_is():
    assert judge_canary(sample(300, latency=105), sample(300), elapsed_s=61, policy=POLICY).action == "promote"
    v = judge_canary(sample(300, latency=150), sample(300), elapsed_s=61, policy=POLICY)
    assert v.action == "rollback" and "latency" in v.reason
    no_latency = VersionSample(300, 0, 0, ())
    assert judge_canary(no_latency, sample(300), elapsed_s=61, policy=POLICY).action == "promote"


HELD = RolloutSettings(held_out_min_samples=50, held_out_tolerance=0.02)


def test_held_out_gate_compares_rates_under_the_newest_spec_with_enough_samples():
    rows = [  # newest spec first: "s2" has too few samples for v5, so "s1" decides
        HeldOutRow("s2", 5, 10, 9.0), HeldOutRow("s2", 4, 500, 300.0),
        HeldOutRow("s1", 5, 100, 50.0), HeldOutRow("s1", 4, 400, 208.0),
    ]
    # s1: v5 0.50 vs v4 0.52: 0.02 below, at the tolerance: passes.
    g = held_out_gate(rows, 5, 4, HELD)
    assert g.ok and "spec s1" in g.reason
    worse = [HeldOutRow("s1", 5, 100, 49.0), HeldOutRow("s1", 4, 400, 208.0)]  # 0.49 vs 0.52
    g = held_out_gate(worse, 5, 4, HELD)
    assert not g.ok and "0.4900" in g.reason and "0.5200" in g.reason


def test_held_out_gate_passes_without_samples_and_says_so():
    g = held_out_gate([HeldOutRow("s1", 4, 400, 208.0)], 5, 4, HELD)
    assert g.ok and "too few samples" in g.reason and "n=0" in g.reason
    assert held_out_gate([], 5, None, HELD).ok


def test_held_out_gate_blocks_a_version_the_reward_guard_flagged():
    rows = [HeldOutRow("s1", 5, 3, 3.0, flagged=True, flag_reason="train +0.4, held-out +0.0"),
            HeldOutRow("s1", 4, 400, 208.0)]
    g = held_out_gate(rows, 5, 4, HELD)
    assert not g.ok and "flagged" in g.reason


def test_parity_gate():
    policy = RolloutSettings(parity_max=0.05)
    assert parity_gate({}, policy).ok
    assert parity_gate({"parity": 0.01}, policy).ok
    assert not parity_gate({"parity": 0.05}, policy).ok
    assert not parity_gate({"parity": math.nan}, policy).ok
    custom = RolloutSettings(parity_metric="parity_max_abs", parity_max=0.5)
    assert not parity_gate({"parity_max_abs": 0.7, "parity": 0.0}, custom).ok


def test_choose_candidate_skips_blocked_ones_newest_first():
    versions = [V(1, "stable"), V(2, "candidate", {"parity": 0.0}), V(3, "candidate", {"parity": 0.9}),
                V(0, "candidate", {})]
    policy = RolloutSettings(parity_max=0.05)
    chosen, seen = choose_candidate(versions, lambda v: [parity_gate(v.metrics, policy)])
    assert chosen == 2 and sorted(seen) == [2, 3] and not seen[3][0].ok
    assert choose_candidate(versions, lambda v: [GateResult(False, "no")]) == (None, {3: [GateResult(False, "no")],
                                                                               2: [GateResult(False, "no")]})


def test_previous_stable_is_the_newest_former_stable_still_usable():
    transitions = [{"version": v, "to_status": "stable"} for v in (0, 2, 3, 5)]
    versions = [V(0, "retired"), V(1, "retired"), V(2, "retired"), V(3, "rolled_back"), V(4, "candidate"),
                V(5, "stable")]
    assert previous_stable(versions, transitions, 5) == 2
    assert previous_stable([V(0, "collected"), V(5, "stable")], transitions, 5) is None


def test_a_canary_no_node_serves_is_rolled_back_after_the_window_not_waited_on_forever():
    starved = sample(0)
    assert judge_canary(starved, sample(1000), elapsed_s=59, policy=POLICY).action == "wait"
    assert judge_canary(starved, sample(99), elapsed_s=1e6, policy=POLICY).action == "wait"  # no traffic at all
    v = judge_canary(starved, sample(100), elapsed_s=60, policy=POLICY)
    assert v.action == "rollback" and "served nothing in 60s while stable served 100" in v.reason
    assert judge_canary(sample(1), sample(1000), elapsed_s=1e6, policy=POLICY).action == "wait"
