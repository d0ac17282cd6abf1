"""Normalisation maths, the held-out split, anomaly detection, and the trainer's use of advantages."""

from __future__ import annotations

import math
import random
import uuid
from statistics import fmean, pstdev

import pytest

from flywheel.events import ScoredTrajectory, Segment, Turn
from rewards.guards import VersionStats, anomalies, held_out_point, is_held_out, served_version
from rewards.normalise import Normaliser, RunningStats, population_std
from rewards.spec import AnomalySpec, NormaliseSpec

pytestmark = pytest.mark.unit


def test_running_stats_is_a_plain_mean_then_exponential() -> None:
    rng = random.Random()
    xs = [rng.gauss(1.0, 2.0) for _ in range(50)]
    stats = RunningStats()
    for x in xs[:10]:
        stats.update(x, decay=0.9)  # 1 / (1 - 0.9) = 10: exact running mean and population variance so far
    assert stats.mean == pytest.approx(fmean(xs[:10]))
    assert stats.var == pytest.approx(pstdev(xs[:10]) ** 2)
    # then exponential with alpha 0.1: recompute by hand
    mean, var = stats.mean, stats.var
    for x in xs[10:]:
        stats.update(x, decay=0.9)
        d = x - mean
        mean += 0.1 * d
        var = 0.9 * (var + 0.1 * d * d)
    assert (stats.count, stats.mean, stats.var) == (50, pytest.approx(mean), pytest.approx(var))


def test_group_relative_advantages_leave_the_sample_out() -> None:
    spec = NormaliseSpec(group_min=2, group_window=3, scale="std", std_floor=0.1, clip=0.0, warmup=2)
    norm = Normaliser(spec)
    norm.observe("t", "m", "p", [1.0])
    norm.observe("t", "m", "p", [0.0, 0.5])
    # group p holds [1.0], [0.0, 0.5]: mean 0.5; std over 1, 0, 0.5 and the sample's own 2.0
    adv = norm.advantages("t", "m", "p", [2.0])
    assert adv == pytest.approx([(2.0 - 0.5) / pstdev([1.0, 0.0, 0.5, 2.0])])
    # the window keeps the newest 3 samples: [0, 0.5], [2.0], [-1.0] after the next one
    norm.advantages("t", "m", "p", [-1.0])
    mean, std, source = norm.baseline("t", "m", "p", [0.0])
    assert source == "group" and mean == pytest.approx(fmean([0.0, 0.5, 2.0, -1.0]))
    assert std == pytest.approx(pstdev([0.0, 0.5, 2.0, -1.0, 0.0]))
    # another tenant or model line with the same prompt is another group (and has no statistics yet)
    assert norm.baseline("t2", "m", "p", [1.0]) == (0.0, 1.0, "running")
    # 'none' only centres
    centred = Normaliser(NormaliseSpec(group_min=1, scale="none", clip=0.0))
    centred.observe("t", "m", "p", [3.0])
    assert centred.advantages("t", "m", "p", [1.0, 4.0]) == [-2.0, 1.0]


def test_running_statistics_when_no_group() -> None:
    spec = NormaliseSpec(group_min=2, decay=0.5, warmup=3, scale="std", std_floor=0.25, clip=3.0)
    norm = Normaliser(spec)
    # nothing seen: mean 0, std 1 -> the raw reward (clipped)
    assert norm.advantages("t", "m", None, [0.5, 7.0]) == [0.5, 3.0]
    # seen 0.5 then 7.0 (alpha 1, then 1/2): mean 3.75; with 1.0 added the stats hold 3 (warm): std from them
    after = RunningStats()
    for x in (0.5, 7.0, 1.0):
        after.update(x, 0.5)
    assert norm.advantages("t", "m", "unique prompt", [1.0]) == pytest.approx([(1.0 - 3.75) / math.sqrt(after.var)])
    # a prompt seen once is not a group yet (group_min 2): running statistics, which moved on
    mean, _, source = norm.baseline("t", "m", "unique prompt", [0.0])
    assert (source, mean) == ("running", pytest.approx(after.mean))
    # the std floor applies to tiny spreads
    flat = Normaliser(NormaliseSpec(group_min=1, std_floor=0.5, clip=0.0))
    flat.observe("t", "m", "q", [1.0])
    assert flat.advantages("t", "m", "q", [1.0 + 1e-9]) == pytest.approx([2e-9])


def test_population_std() -> None:
    assert population_std([1.0, 3.0]) == 1.0


def test_held_out_split_is_deterministic_and_about_the_fraction() -> None:
    sessions = [uuid.uuid4().hex for _ in range(20_000)]
    held = [s for s in sessions if is_held_out("acme", s, 0.05)]
    assert 0.04 < len(held) / len(sessions) < 0.06
    assert all(is_held_out("acme", s, 0.05) for s in held)  # the same answer every time
    assert all(is_held_out("acme", s, 0.2) for s in held)  # a larger slice contains the smaller one
    assert not any(is_held_out("acme", s, 0.0) for s in sessions)
    # the tenant is part of the key: another tenant's session of the same id is another draw
    assert sum(is_held_out("other", s, 0.05) for s in held) < len(held) * 0.2
    assert held_out_point("acme", "s-1") == held_out_point("acme", "s-1") != held_out_point("acme", "s-2")


def test_anomaly_flags_reward_the_held_out_slice_does_not_confirm() -> None:
    spec = AnomalySpec(min_train=10, min_held_out=5, train_jump=0.25, held_out_ratio=0.5)

    def v(version: int, train: float, held: float, n: int = 20, h: int = 10) -> VersionStats:
        return VersionStats(version, n, train * n, h, held * h)

    stats = [
        v(1, 0.10, 0.10),
        v(2, 0.20, 0.18),  # +0.10: below the jump
        v(3, 0.60, 0.45),  # +0.40 train, +0.27 held >= 0.20: confirmed
        v(4, 1.10, 0.50),  # +0.50 train, +0.05 held < 0.25: flagged
        v(5, 0.90, 0.10, n=5),  # too few training samples: not judged, and skipped as a predecessor
        v(6, 1.50, 0.60),  # against v4: +0.40 train, +0.10 held < 0.20: flagged
        v(7, 1.20, 0.70, h=2),  # too few held-out samples
    ]
    flags = anomalies(stats, spec)
    assert {k for k, reason in flags.items() if reason} == {4, 6}
    assert "v3 0.600 -> v4 1.100" in flags[4] and "+0.050" in flags[4]
    assert "v4 1.100 -> v6 1.500" in flags[6]
    assert anomalies([], spec) == {}
    assert VersionStats(1).train_rate is None and VersionStats(1).held_out_rate is None


def test_served_version_is_the_last_turns() -> None:
    t = [Turn(generation_id="a", start=1, end=2, behaviour_version=3),
         Turn(generation_id="b", start=3, end=4, behaviour_version=5)]
    seg = Segment(tokens=[1, 2, 3, 4], mask=[0, 1, 0, 1], logprobs=[0.0, -1.0, 0.0, -1.0], turns=t)
    assert served_version([seg]) == 5 and served_version([]) is None


def test_trainer_uses_carried_advantages_and_falls_back_to_group_baselines() -> None:
    from trainer.loss import turn_values

    seg = Segment(tokens=[1, 2], mask=[0, 1], logprobs=[0.0, -1.0],
                  turns=[Turn(generation_id="g", start=1, end=2, behaviour_version=0)])

    def s(i: int, reward: float, key: str | None, adv: list[float] | None) -> ScoredTrajectory:
        return ScoredTrajectory(tenant="t", session_id=f"s{i}", trajectory_id=f"t{i}", model_line="m", segments=[seg],
                                turn_rewards=[reward], total_reward=reward, reward_spec_version="x", prompt_key=key,
                                turn_advantages=adv)

    samples = [s(0, 1.0, "p", [0.7]), s(1, 1.0, "p", None), s(2, 0.0, "p", None), s(3, 3.0, None, None)]
    # carried: as is, baseline 0; legacy: group p of the legacy samples (1, 0) -> 0.5; s3 alone -> legacy batch mean 4/3
    assert turn_values(samples) == [([0.7], 0.0), ([1.0], 0.5), ([0.0], 0.5), ([3.0], pytest.approx(4 / 3))]
    with pytest.raises(ValueError, match="one entry per turn reward"):
        s(4, 1.0, None, [0.1, 0.2])
    # an old payload (no advantages, no held_out key) still parses
    old = s(5, 1.0, None, None).model_dump(mode="json")
    del old["turn_advantages"], old["held_out"]
    parsed = ScoredTrajectory.model_validate(old)
    assert parsed.turn_advantages is None and parsed.held_out is False
