"""The explicit-outcome reward builder against hand-computed rewards."""

from __future__ import annotations

import math
import random

import pytest

from flywheel.events import FeedbackEvent, Segment, TrajectoryEvent, Turn
from flywheel.settings import RewardSettings
from rewards.builders import explicit_outcome_reward, normalise_rating

pytestmark = pytest.mark.unit

SPEC = RewardSettings()  # thumbs ±1, success 1, failure 0, retry -0.5, abandon -0.5, discount 0.5


def traj(n_turns: int, feedback: list[FeedbackEvent], *, split: bool = False) -> TrajectoryEvent:
    """``n_turns`` one-token turns ``g0..g{n-1}``; ``split`` puts the last turn in its own segment."""
    def segment(ids: list[int]) -> Segment:
        tokens, mask, turns = [], [], []
        for i in ids:
            tokens += [100, i]
            mask += [0, 1]
            turns.append(Turn(generation_id=f"g{i}", start=len(tokens) - 1, end=len(tokens), behaviour_version=0))
        return Segment(tokens=tokens, mask=mask, logprobs=[0.0 if m == 0 else -1.0 for m in mask], turns=turns)

    ids = list(range(n_turns))
    segments = [segment(ids[:-1]), segment(ids[-1:])] if split and n_turns > 1 else [segment(ids)]
    return TrajectoryEvent(
        tenant="t", session_id="s", trajectory_id="tr", model_line="m", segments=segments,
        generation_ids=[f"g{i}" for i in ids], feedback=feedback, closed_reason="outcome",
    )


def fb(signal: str, value: float | None = None, gid: str | None = None) -> FeedbackEvent:
    kind = {"thumbs": "explicit", "rating": "explicit", "comment": "explicit", "retry": "implicit",
            "abandon": "implicit", "task_solved": "outcome", "tests_passed": "outcome"}[signal]
    return FeedbackEvent(tenant="t", session_id="s", feedback_id=f"{signal}-{gid}-{value}-{random.random()}",
                         generation_id=gid, kind=kind, signal=signal, value=value)


def test_docstring_worked_example() -> None:
    out = explicit_outcome_reward(traj(3, [fb("task_solved", 1), fb("thumbs", -1, "g0")]), SPEC)
    assert out.turn_rewards == [-0.75, 0.5, 1.0]
    assert out.total == 0.75
    assert out.components == {"outcome": 1.75, "thumbs": -1.0}


def test_outcome_discount_crosses_segments_and_failure_uses_spec() -> None:
    spec = RewardSettings(outcome_success=2.0, outcome_failure=-1.0, outcome_discount=0.25)
    solved = explicit_outcome_reward(traj(3, [fb("tests_passed", 1)], split=True), spec)
    assert solved.turn_rewards == [2.0 * 0.0625, 2.0 * 0.25, 2.0]
    failed = explicit_outcome_reward(traj(2, [fb("task_solved", 0)]), spec)
    assert failed.turn_rewards == [-0.25, -1.0]
    half = explicit_outcome_reward(traj(1, [fb("tests_passed", 0.5)]), spec)
    assert half.turn_rewards == [0.5]  # -1 + 0.5 * (2 - -1)


def test_outcome_naming_a_turn_anchors_there() -> None:
    out = explicit_outcome_reward(traj(3, [fb("task_solved", 1, "g1")]), SPEC)
    assert out.turn_rewards == [0.5, 1.0, 0.0]


def test_thumbs_retry_abandon_land_on_their_turns() -> None:
    feedback = [fb("thumbs", -1, "g0"), fb("retry", None, "g0"), fb("thumbs", 1, "g1"), fb("abandon", None, "g0")]
    out = explicit_outcome_reward(traj(2, feedback), SPEC)
    # g0: thumbs down -1 + retry -0.5; g1: thumbs up +1 + abandon -0.5 (abandon always hits the last turn)
    assert out.turn_rewards == [-1.5, 0.5]
    assert out.total == -1.0
    assert out.components == {"thumbs": 0.0, "retry": -0.5, "abandon": -0.5}


def test_session_level_signals_hit_the_last_turn_and_unknown_targets_are_ignored() -> None:
    feedback = [fb("thumbs", 1), fb("rating", 5), fb("thumbs", -1, "not-in-trajectory"), fb("comment", None, "g0"),
                fb("thumbs", 0, "g0")]
    out = explicit_outcome_reward(traj(2, feedback), SPEC)
    assert out.turn_rewards == [0.0, 2.0]
    assert out.components == {"thumbs": 1.0, "rating": 1.0}


def test_ratings_normalise() -> None:
    assert [normalise_rating(v) for v in (1, 2, 3, 4, 5)] == [-1.0, -0.5, 0.0, 0.5, 1.0]
    assert normalise_rating(0.25) == 0.25 and normalise_rating(-7) == -1.0 and normalise_rating(9) == 1.0


def test_no_feedback_scores_zero() -> None:
    out = explicit_outcome_reward(traj(2, []), SPEC)
    assert out.turn_rewards == [0.0, 0.0] and out.total == 0.0 and out.components == {}


def test_random_sessions_keep_the_sum_invariants() -> None:
    rng = random.Random()
    for _ in range(50):
        n = rng.randint(1, 5)
        signals = ["thumbs", "rating", "retry", "abandon", "task_solved", "tests_passed"]
        feedback = []
        for _ in range(rng.randint(0, 6)):
            signal = rng.choice(signals)
            value = {"thumbs": rng.choice([-1, 1]), "rating": rng.randint(1, 5)}.get(signal, rng.choice([0, 1, None]))
            feedback.append(fb(signal, value, rng.choice([None] + [f"g{i}" for i in range(n)])))
        out = explicit_outcome_reward(traj(n, feedback, split=rng.random() < 0.5), SPEC)
        assert len(out.turn_rewards) == n
        assert math.isclose(out.total, sum(out.turn_rewards), abs_tol=1e-9)
        assert math.isclose(out.total, sum(out.components.values()), abs_tol=1e-9)
